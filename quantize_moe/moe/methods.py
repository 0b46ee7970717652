"""Quantization-method objects of the fused-MoE layer (the seed's FusedMoEMethodBase idea).

A method creates the layer's parameters (bf16 weights, or fp8 weights with scales
shaped as `quant_spec.py` says), post-processes them after loading, and runs the
layer. Every parameter carries `shard_kind`, which tells the layer's one shared
weight loader how a checkpoint tensor of shard w1/w2/w3 lands in it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from quantize_moe.errors import UserError
from quantize_moe.quantization import fp8
from quantize_moe.quantization.spec import UNQUANTIZED, MoEQuantSpec

# shard_kind values
WEIGHT = "weight"  # [E, rows, cols]: w1 fills the first half of w13's rows, w3 the second
TENSOR_SCALE = "tensor_scale"  # w13: [E, 2] (gate, up) until max-requantized to [E]; w2: [E]
ROW_SCALE = "row_scale"  # per-channel [E, rows] or per-block [E, row_blocks, col_blocks]
INPUT_SCALE = "input_scale"  # static activation scale [E]: w1 and w3 of an expert must carry the same one


def _param(shape: tuple[int, ...], dtype: torch.dtype, kind: str) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.shard_kind = kind
    return p


def layer_input_scale(scales: torch.Tensor, names: list[str]) -> torch.Tensor:
    """Static input scales (of a layer's experts, or of one module) reduced to their max, float32 [1],
    after checking each is finite and positive (NaN or zero would turn every input into NaN or
    infinity); `names[i]` says whose the i-th scale is."""
    scales = scales.float().flatten()
    bad = torch.nonzero(~torch.isfinite(scales) | (scales <= 0)).flatten().tolist()
    if bad:
        raise UserError(f"{names[bad[0]]} is {scales[bad[0]].item():.6g}; a static input scale must be finite and "
                        "positive (recalibrate the checkpoint).")
    return scales.max().reshape(1)


class FusedMoEMethodBase:
    spec: MoEQuantSpec = UNQUANTIZED

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, expert_width: int,
                       params_dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn loaded checkpoint tensors into what `apply` expects."""

    def scales(self, layer: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return None, None

    def input_scales(self, layer: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(a13 [1], a2 [1]) static activation scales of the two GEMMs after loading, or (None, None)."""
        return None, None

    def kernel_args(self, layer: nn.Module) -> dict:
        """The scale arguments of `fused_experts` and its torch reference for this layer."""
        (w13_scale, w2_scale), (a13_scale, a2_scale) = self.scales(layer), self.input_scales(layer)
        return dict(quant=self.spec, w13_scale=w13_scale, w2_scale=w2_scale, a13_scale=a13_scale,
                    a2_scale=a2_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              *, use_kernels: bool) -> torch.Tensor:
        args = (x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        kwargs = self.kernel_args(layer)
        if use_kernels:
            from quantize_moe.kernels import fused_experts
            return fused_experts(*args, **kwargs)
        from quantize_moe.moe.reference import fused_experts_reference
        return fused_experts_reference(*args, **kwargs).to(x.dtype)


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    def create_weights(self, layer, num_experts, hidden_size, expert_width, params_dtype):
        layer.w13_weight = _param((num_experts, 2 * expert_width, hidden_size), params_dtype, WEIGHT)
        layer.w2_weight = _param((num_experts, hidden_size, expert_width), params_dtype, WEIGHT)


class Fp8FusedMoEMethod(FusedMoEMethodBase):
    """FP8 weights with per-tensor, per-channel or 128x128-block scales."""

    def __init__(self, spec: MoEQuantSpec):
        assert spec.is_fp8
        self.spec = spec

    def create_weights(self, layer, num_experts, hidden_size, expert_width, params_dtype):
        E, H, I = num_experts, hidden_size, expert_width
        layer.w13_weight = _param((E, 2 * I, H), fp8.FP8_DTYPE, WEIGHT)
        layer.w2_weight = _param((E, H, I), fp8.FP8_DTYPE, WEIGHT)
        if self.spec.weight == "tensor":
            layer.w13_weight_scale = _param((E, 2), torch.float32, TENSOR_SCALE)
            layer.w2_weight_scale = _param((E,), torch.float32, TENSOR_SCALE)
        elif self.spec.weight == "channel":
            layer.w13_weight_scale = _param((E, 2 * I), torch.float32, ROW_SCALE)
            layer.w2_weight_scale = _param((E, H), torch.float32, ROW_SCALE)
        else:
            bn, bk = self.spec.block_shape
            # Gate blocks then up blocks: engines need I % bn == 0 so the halves do not share a block.
            layer.w13_weight_scale = _param((E, 2 * math.ceil(I / bn), math.ceil(H / bk)), torch.float32,
                                            ROW_SCALE)
            layer.w2_weight_scale = _param((E, math.ceil(H / bn), math.ceil(I / bk)), torch.float32, ROW_SCALE)
        if self.spec.static:
            layer.w13_input_scale = _param((E,), torch.float32, INPUT_SCALE)
            layer.w2_input_scale = _param((E,), torch.float32, INPUT_SCALE)

    def process_weights_after_loading(self, layer):
        if self.spec.static:
            self._reduce_input_scales(layer)
        self._requantize_w13(layer)

    @staticmethod
    def _reduce_input_scales(layer):
        """Every expert's GEMM quantizes its input with the layer's one scale, as in vLLM's Fp8MoEMethod."""
        for name in ("w13_input_scale", "w2_input_scale"):
            scales = getattr(layer, name).data
            reduced = layer_input_scale(scales, [f"{layer.name}: expert {e}'s {name}" for e in range(len(scales))])
            setattr(layer, name, _param((1,), torch.float32, INPUT_SCALE))
            getattr(layer, name).data.copy_(reduced)

    def _requantize_w13(self, layer):
        """Per-tensor: gate and up may carry different scales (AutoFP8, llm-compressor); requantize both
        halves with their max, as vLLM does, so one scale per expert reaches the kernel."""
        if self.spec.weight != "tensor" or layer.w13_weight_scale.dim() == 1:
            return
        scales = layer.w13_weight_scale.data
        shared = scales.max(dim=1).values
        I = layer.w13_weight.shape[1] // 2
        layer.requantized_experts = 0
        for e in torch.nonzero(scales[:, 0] != scales[:, 1]).flatten().tolist():
            for half in range(2):
                rows = layer.w13_weight.data[e, half * I:(half + 1) * I]
                rows.copy_(fp8.quantize(fp8.dequantize(rows.cpu(), scales[e, half].cpu()), shared[e].cpu())
                           .to(rows.device))
            layer.requantized_experts += 1
        layer.w13_weight_scale = _param(shared.shape, torch.float32, TENSOR_SCALE)
        layer.w13_weight_scale.data.copy_(shared)

    def scales(self, layer):
        return layer.w13_weight_scale.data, layer.w2_weight_scale.data

    def input_scales(self, layer):
        if not self.spec.static:
            return None, None
        return layer.w13_input_scale.data, layer.w2_input_scale.data


def method_for_spec(spec: MoEQuantSpec) -> FusedMoEMethodBase:
    return Fp8FusedMoEMethod(spec) if spec.is_fp8 else UnquantizedFusedMoEMethod()
