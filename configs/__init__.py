"""Tuned launch configs of the fused-MoE kernels, one JSON file per shape and dtype."""
