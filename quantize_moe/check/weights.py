"""Offline numeric check of a produced checkpoint against its source, layer by layer.

Loads the stacked experts of both through the same FusedMoE weight loader, a few
experts at a time (so memory stays flat whatever the layer size), and checks every
dequantized expert weight against the FP8 e4m3 rounding bound, in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantize_moe.quantization import fp8
from quantize_moe.check.moe_layers import MoECheckpoint
from quantize_moe.quantization.spec import expand_weight_scale


@dataclass(frozen=True)
class LayerWeightCheck:
    layer: int
    relative_error: float  # ||deq - w|| / ||w|| over w13 and w2 together
    worst_bound_ratio: float  # max |deq - w| / rounding bound: <= 1 means within FP8 rounding

    @property
    def ok(self) -> bool:
        return self.worst_bound_ratio <= 1.0


def check_expert_weights(src: str | Path, dst: str | Path, adapter: str | None = None) -> list[LayerWeightCheck]:
    original, quantized = MoECheckpoint.open(src, adapter), MoECheckpoint.open(dst, adapter)
    results = []
    for layer in sorted(original.layers):
        err = norm = worst = 0.0
        for experts in original.expert_chunks(layer):
            a, b = original.load_experts(layer, experts), quantized.load_experts(layer, experts)
            for w, deq, q, scale in zip(a.dequantized_weights(), b.dequantized_weights(),
                                        (b.w13_weight, b.w2_weight), b.quant_method.scales(b)):
                bound = fp8.rounding_bound(w, expand_weight_scale(scale, quantized.spec, q.shape))
                difference = deq - w
                worst = max(worst, (difference.abs() / bound).max().item())
                err += difference.pow_(2).sum().item()
                norm += w.pow(2).sum().item()
            del a, b
        results.append(LayerWeightCheck(layer, (err / max(norm, 1e-300)) ** 0.5, worst))
    original.checkpoint.close()
    quantized.checkpoint.close()
    return results
