"""Every MoE family, end to end on tiny checkpoints written by transformers' own `save_pretrained`.

The central check: our stacked w13/w2 view of a checkpoint's experts (loaded through the
adapter and the FusedMoE weight loader) computes exactly what the family's transformers
MoE block computes. The routing is the family's own, captured where its block calls its
experts (moe_blocks.py), so these tests isolate the layout mapping; routing rules are
checked in test_routing.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_blocks import expert_call
from quantize_moe.adapters import Kind
from quantize_moe.check.weights import check_expert_weights
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.write.dequantize import dequantize_checkpoint
from quantize_moe.errors import UserError
from quantize_moe.check.moe_layers import MoECheckpoint
from quantize_moe.moe.reference import fused_experts_reference
from quantize_moe.plan.options import Options
from quantize_moe.plan.plan import MTP_REASON, make_plan
from quantize_moe.write.job import quantize_checkpoint
from quantize_moe.source.tiny import TINY_CONFIGS, add_mtp_layer, build_tiny_checkpoint, to_block_fp8

FAMILIES = sorted(TINY_CONFIGS)
REFUSED = {"gpt_oss"}  # FP8 output loads in no engine
TOKENS = 29


def _swigluoai_reference(x, w13, w2, b13, b2, weights, ids, alpha=1.702, limit=7.0):
    """gpt-oss experts from the stacked view: biases and clamped SwiGLU, (up + 1) * glu."""
    width = w2.shape[2]
    out = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        for e in ids[:, k].unique().tolist():
            rows = ids[:, k] == e
            gate_up = x[rows] @ w13[e].T + b13[e]
            gate, up = gate_up[:, :width].clamp(max=limit), gate_up[:, width:].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(gate * alpha)
            out[rows] += (act @ w2[e].T + b2[e]) * weights[rows, k, None]
    return out


@pytest.mark.parametrize("model_type", FAMILIES)
def test_stacked_view_matches_transformers_moe_block(model_type, tiny_checkpoint):
    folder = tiny_checkpoint(model_type)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = MoECheckpoint.open(folder)
    assert ours.layers, "the adapter finds no MoE layer"
    torch.manual_seed(1)
    for layer in ours.layers:
        args, theirs = expert_call(model, layer, torch.randn(1, TOKENS, ours.layers[layer].hidden_size))
        moe = ours.load_layer(layer, params_dtype=torch.float32)
        w13, w2 = moe.w13_weight.data, moe.w2_weight.data  # float32 parameters of bf16 experts
        x = args[0].reshape(-1, w2.shape[1])
        if len(args) == 1:  # Llama-4: router weights already applied to the input, one expert per row block
            ids = torch.arange(ours.layers[layer].num_experts).repeat_interleave(TOKENS)[:, None]
            expected = fused_experts_reference(x, w13, w2, torch.ones(len(ids), 1), ids)
        elif ours.family.activation == "swigluoai":
            expected = _swigluoai_reference(x, w13, w2, *ours.load_biases(layer), args[2].float(), args[1])
        else:
            expected = fused_experts_reference(x, w13, w2, args[2].float(), args[1])
        torch.testing.assert_close(theirs.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_plan_classifies_every_tensor(model_type, tiny_checkpoint):
    plan = make_plan(Checkpoint(tiny_checkpoint(model_type)))
    kinds = {d.role.kind for d in plan.decisions.values()}
    assert {Kind.ROUTED_EXPERT, Kind.ROUTER} <= kinds
    routers = [d for d in plan.decisions.values() if d.role.kind == Kind.ROUTER]
    assert all(not d.quantize for d in routers)
    assert {d.role.module for d in routers if d.role.is_linear_weight} <= set(plan.ignored_modules)
    for d in plan.decisions.values():
        if any(part in d.info.name for part in ("mamba.", "linear_attn.")):
            assert not d.quantize, f"{d.info.name}: hybrid mixers stay bf16"


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_fp8_output_no_engine_loads_is_refused(model_type, tiny_checkpoint, tmp_path):
    with pytest.raises(UserError, match="nowhere"):
        quantize_checkpoint(tiny_checkpoint(model_type), tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_mtp_layer_kept_in_high_precision_and_listed(model_type, tmp_path):
    folder = add_mtp_layer(build_tiny_checkpoint(model_type, tmp_path / "src"))
    plan = make_plan(Checkpoint(folder))
    mtp = plan.config.num_hidden_layers
    assert plan.mtp_layers == [mtp]
    kept = [d for name, d in plan.decisions.items() if name.startswith(f"model.layers.{mtp}.")]
    assert kept and not any(d.quantize for d in kept)
    assert all(d.reason == MTP_REASON for d in kept if d.role.kind in (Kind.ROUTED_EXPERT, Kind.LINEAR))
    assert f"model.layers.{mtp}.mlp.experts" in plan.ignored_modules
    assert mtp not in MoECheckpoint.open(folder).layers


def test_block_fp8_source_requantized_and_dequantized(tmp_path):
    src = to_block_fp8(build_tiny_checkpoint("deepseek_v3", tmp_path / "bf16"), tmp_path / "block", (32, 32))
    dst = tmp_path / "fp8"
    with pytest.raises(UserError, match="--requantize"):
        quantize_checkpoint(src, dst, show_progress=False)
    quantize_checkpoint(src, dst, Options(requantize=True), show_progress=False)
    out = Checkpoint(dst)
    assert not any(name.endswith("weight_scale_inv") for name in out.tensors)
    assert json.loads((dst / "config.json").read_text())["quantization_config"].get("weight_block_size") is None
    assert all(c.ok for c in check_expert_weights(src, dst))  # against the dequantized source
    dequantize_checkpoint(src, tmp_path / "deq")
    deq = Checkpoint(tmp_path / "deq")
    assert all(i.dtype != torch.float8_e4m3fn for i in deq.tensors.values())
    assert not any(name.endswith("weight_scale_inv") for name in deq.tensors)


def test_mxfp4_source_refused(tiny_checkpoint, tmp_path):
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    src = tiny_checkpoint("gpt_oss")
    for path in src.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(UserError, match="MXFP4"):
        dequantize_checkpoint(folder, tmp_path / "out")


def test_dequantize_refuses_unquantized_source(tiny_checkpoint, tmp_path):
    with pytest.raises(UserError, match="not quantized"):
        dequantize_checkpoint(tiny_checkpoint("mixtral"), tmp_path / "out")


def test_llama4_keeps_q_k_v_in_bf16_under_compressed_tensors_block_only(block_friendly):
    """vLLM permutes Llama-4's q/k rows and any q/k `weight_scale` with more than one element for its rotary
    embedding; 128x128 blocks cannot follow, so q/k (and v, fused with them) stay bf16 there alone."""
    src = Checkpoint(block_friendly("llama4_text"))
    attention = "model.layers.0.self_attn.{}_proj.weight"
    kept = make_plan(src, Options(format="compressed-tensors", scheme="block"))
    assert not any(kept.decisions[attention.format(p)].quantize for p in "qkv")
    assert "rotary" in kept.decisions[attention.format("q")].reason
    assert {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"} <= set(kept.ignored_modules)
    for fmt, scheme in [("fp8", "block"), ("compressed-tensors", "channel")]:
        assert all(make_plan(src, Options(format=fmt, scheme=scheme)).decisions[attention.format(p)].quantize
                   for p in "qkv")
