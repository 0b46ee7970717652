"""Checking a produced checkpoint: weights, layers through the fused-MoE layer, verify, evaluation."""
