"""Triton kernels of the fused-MoE layer (installed as quantize_moe.kernels)."""

from quantize_moe.kernels.fused_moe import fused_experts

__all__ = ["fused_experts"]
