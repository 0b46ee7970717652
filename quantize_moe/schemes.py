"""Quantization schemes: how scales are laid over a weight, and how a group shares them.

The gate and up projections of one expert are quantized as a group: under the
per-tensor scheme they share one scale (the max of their amax), which makes vLLM's
load-time max-requantization of w13 exact instead of a second rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantize_moe import fp8
from quantize_moe.moe.quant_spec import MoEQuantSpec


@dataclass(frozen=True)
class QuantizedWeight:
    weight: torch.Tensor  # float8_e4m3fn, same shape as the original
    scale: torch.Tensor  # float32, shape `Scheme.scale_shape(weight.shape)`


class PerTensorScheme:
    """One float32 scale per weight (per expert and projection)."""

    name = "tensor"
    moe_spec = MoEQuantSpec(weight="tensor", activation="token")

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return ()

    def quantize_group(self, named_weights: list[tuple[str, torch.Tensor]]) -> list[QuantizedWeight]:
        """Quantize weights that must share one scale (gate and up of one expert)."""
        group_amax = torch.stack([fp8.amax(w, name) for name, w in named_weights]).max()
        scale = fp8.scale_from_amax(group_amax)
        return [QuantizedWeight(fp8.quantize(w, scale), scale.clone()) for _, w in named_weights]

    def quantize_experts(self, named_weights: list[tuple[str, torch.Tensor]],
                         num_experts: int) -> list[QuantizedWeight]:
        """Quantize fused tensors that each hold every expert of a layer (experts lead in every
        layout): one scale per expert, shared by all the tensors (DBRX w1 and v1). Scales `[E]`."""
        per_expert = [(name, w.reshape(num_experts, -1)) for name, w in named_weights]
        group_amax = torch.stack([fp8.row_amax(w, name) for name, w in per_expert]).amax(dim=0)
        scale = fp8.scale_from_amax(group_amax)
        return [QuantizedWeight(fp8.quantize(w, scale).reshape(original.shape), scale.clone())
                for (_, w), (_, original) in zip(per_expert, named_weights)]

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fp8.dequantize(q, scale)


SCHEMES = {scheme.name: scheme for scheme in (PerTensorScheme(),)}
