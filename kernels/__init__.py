"""Triton kernels of the fused-MoE layer (installed as quantize_moe.kernels)."""
