"""The FusedMoE layer's shared (shard id, expert id) weight loader and method objects."""

from __future__ import annotations

import pytest
import torch

from quantize_moe.quantization import fp8
from quantize_moe.errors import UserError
from quantize_moe.moe.layer import FusedMoE
from quantize_moe.moe.methods import Fp8FusedMoEMethod, UnquantizedFusedMoEMethod
from quantize_moe.moe.reference import dequantize_weight
from quantize_moe.quantization.spec import MoEQuantSpec

E, H, I = 3, 16, 8


def experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{s: torch.randn(*(H, I) if s == "w2" else (I, H), generator=g) for s in ("w1", "w3", "w2")}
            for _ in range(E)]


def load(layer: FusedMoE, tensors: list[dict], scales: list[dict] | None = None) -> FusedMoE:
    params = dict(layer.named_parameters())
    for e, shards in enumerate(tensors):
        for shard, tensor in shards.items():
            prefix = "w2" if shard == "w2" else "w13"
            layer.weight_loader(params[f"{prefix}_weight"], tensor, f"{prefix}_weight", shard, e)
            if scales is not None:
                layer.weight_loader(params[f"{prefix}_weight_scale"], scales[e][shard], f"{prefix}_weight_scale",
                                    shard, e)
    layer.process_weights_after_loading()
    return layer


def test_unquantized_stacked_view_puts_gate_rows_first():
    tensors = experts()
    layer = load(FusedMoE(E, H, I, UnquantizedFusedMoEMethod(), torch.float32), tensors)
    for e in range(E):
        assert torch.equal(layer.w13_weight[e, :I], tensors[e]["w1"])
        assert torch.equal(layer.w13_weight[e, I:], tensors[e]["w3"])
        assert torch.equal(layer.w2_weight[e], tensors[e]["w2"])


def quantize_each(tensors, share_gate_up: bool):
    """Per-tensor quantization as a foreign tool might do it, optionally with separate gate/up scales."""
    q, s = [], []
    for shards in tensors:
        amax = {k: v.abs().max() for k, v in shards.items()}
        if share_gate_up:
            amax["w1"] = amax["w3"] = torch.maximum(amax["w1"], amax["w3"])
        scale = {k: fp8.scale_from_amax(a) for k, a in amax.items()}
        q.append({k: fp8.quantize(v, scale[k]) for k, v in shards.items()})
        s.append(scale)
    return q, s


def test_shared_gate_up_scales_load_without_requantization():
    tensors = experts()
    q, s = quantize_each(tensors, share_gate_up=True)
    layer = load(FusedMoE(E, H, I, Fp8FusedMoEMethod(MoEQuantSpec("tensor"))), q, s)
    assert layer.requantized_experts == 0
    for e in range(E):
        assert torch.equal(layer.w13_weight[e, :I].view(torch.uint8), q[e]["w1"].view(torch.uint8))
        assert layer.w13_weight_scale[e] == s[e]["w1"]


def test_separate_gate_up_scales_are_max_requantized_like_vllm():
    tensors = experts()
    tensors[1]["w3"] *= 10  # expert 1's up projection has a much larger range than its gate
    q, s = quantize_each(tensors, share_gate_up=False)
    layer = load(FusedMoE(E, H, I, Fp8FusedMoEMethod(MoEQuantSpec("tensor"))), q, s)
    assert layer.requantized_experts == E  # random tensors never have equal amax
    assert layer.w13_weight_scale.shape == (E,)
    assert layer.w13_weight_scale[1] == s[1]["w3"]
    w13 = dequantize_weight(layer.w13_weight, layer.w13_weight_scale, layer.quant_method.spec, torch.float32)
    original = torch.stack([torch.cat([t["w1"], t["w3"]]) for t in tensors])
    # Two roundings: within twice the bound of the shared scale.
    bound = 2 * fp8.rounding_bound(original, layer.w13_weight_scale.reshape(E, 1, 1))
    assert ((w13 - original).abs() <= bound).all()


def test_missing_expert_is_reported():
    tensors = experts()
    del tensors[2]["w3"]
    with pytest.raises(UserError, match="expert 2 has no w3 tensor for w13_weight"):
        load(FusedMoE(E, H, I, UnquantizedFusedMoEMethod(), torch.float32), tensors)


def test_wrong_shape_is_reported():
    tensors = experts()
    tensors[0]["w2"] = tensors[0]["w2"][:, :4]
    with pytest.raises(UserError, match=r"expert 0 w2 tensor for w2_weight has shape \(16, 4\)"):
        load(FusedMoE(E, H, I, UnquantizedFusedMoEMethod(), torch.float32), tensors)
