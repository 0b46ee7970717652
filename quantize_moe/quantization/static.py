"""Static activations: what calibration measured (`ActivationAmax`) and the input scales made of it.

Calibration (`run/calibration.py`) fills an `ActivationAmax`; the plan names an `input_scale` per quantized
Linear and writing takes the values from here, so the stages below `run/` never import it. A static
input scale is per tensor, `amax / 448`, the dequantization multiplier like every scale here."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantize_moe.quantization.fp8 import FP8_MAX

KV_SCALES = ("k_scale", "v_scale")  # vLLM's names, under `model.layers.N.self_attn.`
# How compressed-tensors (and vLLM reading it) declares a per-tensor FP8 KV cache.
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
W13, W2 = "w13", "w2"  # the input of gate/up (the MoE block input) and of down (act(gate) * up)
# An input that calibration saw only as zeros still gets a positive scale, as compressed-tensors clamps it.
MIN_SCALE = float(torch.finfo(torch.float32).eps)


def input_scale(amax: float) -> float:
    return max(amax / FP8_MAX, MIN_SCALE)


@dataclass
class ActivationAmax:
    """Largest input magnitudes seen over the calibration tokens: per Linear module name (attention
    projections, dense and shared MLPs), per routed expert `(layer, expert, W13 | W2)`, and with an FP8 KV
    cache the keys and values attention caches, by scale name (`model.layers.0.self_attn.k_scale`)."""

    linears: dict[str, float] = field(default_factory=dict)
    kv: dict[str, float] = field(default_factory=dict)
    experts: dict[tuple[int, int, str], float] = field(default_factory=dict)
    routed_tokens: dict[int, list[int]] = field(default_factory=dict)  # MoE layer -> tokens routed per expert
    tokens: int = 0

    def summary(self) -> list[dict]:
        """Per decoder layer: experts that routing sent tokens to, the smallest and largest input scale
        (its Linears and its experts) and its KV-cache scales: the report table and the run record."""
        scales: dict[int, list[float]] = {}
        for name, value in self.linears.items():
            scales.setdefault(int(name.split(".")[2]), []).append(input_scale(value))
        for (layer, _, _), value in self.experts.items():
            scales.setdefault(layer, []).append(input_scale(value))
        kv: dict[int, dict[str, float]] = {}
        for name, value in self.kv.items():
            kv.setdefault(int(name.split(".")[2]), {})[name.rpartition(".")[2]] = input_scale(value)
        rows = []
        for layer in sorted(scales.keys() | kv.keys()):
            routed, values = self.routed_tokens.get(layer), scales.get(layer)
            rows.append({"layer": layer, "experts_routed": sum(n > 0 for n in routed) if routed else None,
                         "experts": len(routed) if routed else None, "min_scale": min(values) if values else None,
                         "max_scale": max(values) if values else None, **kv.get(layer, {})})
        return rows
