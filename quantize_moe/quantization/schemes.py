"""Quantization schemes: how scales are laid over a weight, and how a group shares them.

A scheme is a cell shape (the part of a 2-D weight one scale covers) and
whether a group of weights shares its scales. The arithmetic lives in a
backend with one function, `quantize_cells` (`quantize_moe.quantization.fp8` on the CPU,
`quantize_moe.quantization.cuda` on a GPU), so every backend quantizes bit-identically.

The gate and up projections of one expert are quantized as a group: under the
per-tensor scheme they share one scale (the max of their amax), which makes vLLM's
load-time max-requantization of w13 exact instead of a second rounding. Per-channel
and block scales are concatenated as they are when engines fuse w13, so those
schemes share nothing.

Scales stored in a narrower dtype than float32 (compressed-tensors writes the
model's dtype) are rounded to it before the weight is divided by them, so a
reader multiplies by exactly the scale that was used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantize_moe.quantization import fp8
from quantize_moe.quantization.spec import MoEQuantSpec


@dataclass(frozen=True)
class QuantizedWeight:
    weight: torch.Tensor  # float8_e4m3fn, same shape as the original
    scale: torch.Tensor  # float32 holding `scale_dtype` values, shape `Scheme.scale_shape(weight.shape)`


class Scheme:
    name: str
    moe_spec: MoEQuantSpec
    shares_group_scale: bool

    def cell(self, shape: tuple[int, int]) -> tuple[int, int]:
        raise NotImplementedError

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return fp8.grid_shape(shape, self.cell(shape))

    def misfit(self, shape: tuple[int, ...]) -> str | None:
        """Why a weight of this shape cannot take the scheme in every engine that reads it, or None."""
        return None

    def quantize_group_into(self, named_weights: list[tuple[str, torch.Tensor]], outs: list[torch.Tensor],
                            backend=fp8, scale_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """Quantize weights that form one group into the fp8 tensors `outs`; returns their scales,
        float32 in `fp8.grid_shape` (reshape to `scale_shape` for the disk)."""
        amaxes = [None] * len(named_weights)
        if self.shares_group_scale:
            group_amax = torch.stack([backend.grid_amax(w, self.cell(w.shape), name)
                                      for name, w in named_weights]).amax(dim=0)
            amaxes = [group_amax] * len(named_weights)
        if scale_dtype != torch.float32:
            # Every backend divides amax by 448: handing it 448 x the stored scale (exact for the
            # 8-11 significant bits of bf16/fp16) makes it quantize with exactly that scale.
            amaxes = [fp8.scale_from_amax(backend.grid_amax(w, self.cell(w.shape), name) if a is None else a,
                                          scale_dtype) * fp8.FP8_MAX
                      for (name, w), a in zip(named_weights, amaxes)]
        return [backend.quantize_cells(w, self.cell(w.shape), out, name, amax)
                for (name, w), out, amax in zip(named_weights, outs, amaxes)]

    def quantize_group(self, named_weights: list[tuple[str, torch.Tensor]],
                       scale_dtype: torch.dtype = torch.float32) -> list[QuantizedWeight]:
        """The CPU path with freshly allocated outputs."""
        outs = [torch.empty(w.shape, dtype=fp8.FP8_DTYPE) for _, w in named_weights]
        scales = self.quantize_group_into(named_weights, outs, scale_dtype=scale_dtype)
        return [QuantizedWeight(q, s.reshape(self.scale_shape(q.shape))) for q, s in zip(outs, scales)]

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        cell_rows, cell_cols = self.cell(q.shape)
        grid = scale.reshape(fp8.grid_shape(q.shape, (cell_rows, cell_cols)))
        full = grid.repeat_interleave(cell_rows, 0).repeat_interleave(cell_cols, 1)
        return q.float() * full[:q.shape[0], :q.shape[1]]


class PerTensorScheme(Scheme):
    """One float32 scale per weight (per expert and projection)."""

    name = "tensor"
    moe_spec = MoEQuantSpec(weight="tensor", activation="token")
    shares_group_scale = True

    def cell(self, shape):
        return tuple(shape)

    def scale_shape(self, shape):
        return ()

    def quantize_experts(self, named_weights: list[tuple[str, torch.Tensor]],
                         num_experts: int) -> list[QuantizedWeight]:
        """Quantize fused tensors that each hold every expert of a layer (experts lead in every
        layout): one scale per expert, shared by all the tensors (DBRX w1 and v1). Scales `[E]`."""
        per_expert = [(name, w.reshape(num_experts, -1)) for name, w in named_weights]
        group_amax = torch.stack([fp8.row_amax(w, name) for name, w in per_expert]).amax(dim=0)
        scale = fp8.scale_from_amax(group_amax)
        return [QuantizedWeight(fp8.quantize(w, scale).reshape(original.shape), scale.clone())
                for (_, w), (_, original) in zip(per_expert, named_weights)]


class PerChannelScheme(Scheme):
    """One float32 scale per output channel (row), `[rows, 1]`."""

    name = "channel"
    moe_spec = MoEQuantSpec(weight="channel", activation="token")
    shares_group_scale = False

    def cell(self, shape):
        return 1, shape[1]


class BlockScheme(Scheme):
    """One float32 scale per 128x128 block, `[ceil(rows/128), ceil(cols/128)]` (DeepSeek-V3 style)."""

    name = "block"
    block = (128, 128)
    moe_spec = MoEQuantSpec(weight="block", activation="group", block_shape=block)
    shares_group_scale = False

    def cell(self, shape):
        return self.block

    def misfit(self, shape):
        """transformers cannot dequantize partial blocks, and vLLM's block-FP8 MoE needs whole ones."""
        if all(n % b == 0 for n, b in zip(shape, self.block)):
            return None
        return (f"{shape[0]} x {shape[1]} is not a multiple of the {self.block[0]} x {self.block[1]} block "
                "(transformers cannot dequantize partial blocks)")


SCHEMES = {scheme.name: scheme for scheme in (PerTensorScheme(), PerChannelScheme(), BlockScheme())}
