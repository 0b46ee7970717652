"""End-to-end checks of `quantize` on tiny checkpoints of every family whose FP8 output an engine loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from quantize_moe.quantization import fp8
from transformers import AutoModelForCausalLM

from quantize_moe.adapters import Kind, adapter_for
from quantize_moe.adapters.fused import scale_name
from quantize_moe.check.weights import check_expert_weights
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.write.dequantize import dequantize_checkpoint
from quantize_moe.plan.options import Options
from quantize_moe.write.job import quantize_checkpoint
from quantize_moe.source.tiny import TINY_CONFIGS

FAMILIES = sorted(t for t in TINY_CONFIGS if not adapter_for({"model_type": t}).fp8_refusal)
# Per-tensor native fp8 throughout; the other formats and schemes are tested in test_schemes.py.
SMALL_SHARDS = Options(format="fp8", scheme="tensor", max_shard_size=60_000)


def scale_of(name: str) -> str:
    """The scale tensor of a quantized weight: `x.weight_scale`, or DBRX `mlp.w1_weight_scale`."""
    return scale_name(name, "weight_scale")


def read_all(folder) -> dict[str, torch.Tensor]:
    checkpoint = Checkpoint(folder)
    return {name: checkpoint.get(name) for name in checkpoint.tensors}


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint, tmp_path_factory):
    """model_type -> (src folder, dst folder, summary), quantized with small output shards."""
    results = {}
    for model_type in FAMILIES:
        src = tiny_checkpoint(model_type)
        (src / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
        dst = tmp_path_factory.mktemp(f"dst-{model_type}")
        results[model_type] = (src, dst, quantize_checkpoint(src, dst, SMALL_SHARDS, overwrite=True,
                                                             show_progress=False))
    return results


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_tensor_has_the_right_dtype_and_shape(quantized, model_type):
    src, dst, summary = quantized[model_type]
    before, after = read_all(src), read_all(dst)
    plan, decisions = summary.plan, summary.plan.decisions
    quantized_names = {n for n, d in decisions.items() if d.quantize}
    num_experts = {m.layer: m.num_experts for m in plan.moe_layers}
    written = {out: (name, shape) for name, tensor in before.items()  # Llama-4's experts unfused
               for out, shape in plan.family.written_as(name, tensor.shape, num_experts)}
    assert set(after) == set(written) | {scale_of(out) for out, (name, _) in written.items() if name in quantized_names}
    for out, (name, shape) in written.items():
        if name in quantized_names:
            assert after[out].dtype == torch.float8_e4m3fn and after[out].shape == shape
            scale = after[scale_of(out)]
            layout = decisions[name].role.fused
            scale_shape = () if out != name or layout is None else layout.scale_shape(num_experts[decisions[name].role.layer])
            assert scale.dtype == torch.float32 and scale.shape == scale_shape and (scale > 0).all()
        else:
            assert after[name].dtype == before[name].dtype
            assert torch.equal(after[name].view(torch.uint8), before[name].view(torch.uint8)), name


@pytest.mark.parametrize("model_type", FAMILIES)
def test_quantized_linears_outside_the_experts_are_within_fp8_rounding(quantized, model_type):
    """Routed experts are checked through their stacked views below and pinned byte for byte in
    test_written_bytes; this covers the other quantized Linears (attention, dense and shared MLPs)."""
    src, dst, summary = quantized[model_type]
    before, after = read_all(src), read_all(dst)
    others = [n for n, d in summary.plan.decisions.items() if d.quantize and d.role.kind != Kind.ROUTED_EXPERT]
    assert others
    for name in others:
        q, scale, original = after[name], after[scale_of(name)], before[name]
        error = (q.float() * scale - original.float()).abs()
        assert (error <= fp8.rounding_bound(original, scale)).all(), name


@pytest.mark.parametrize("model_type", FAMILIES)
def test_what_is_quantized_follows_the_roles(quantized, model_type):
    _, _, summary = quantized[model_type]
    kinds = {}
    for d in summary.plan.decisions.values():
        kinds.setdefault(d.role.kind, set()).add(d.quantize)
    assert kinds[Kind.ROUTED_EXPERT] == {True}
    assert kinds[Kind.LINEAR] == {True}
    assert kinds[Kind.ROUTER] == {False}
    assert kinds[Kind.HIGH_PRECISION] == {False}
    kept = {n for n, d in summary.plan.decisions.items() if not d.quantize}
    embedding = "transformer.wte.weight" if model_type == "dbrx" else "model.embed_tokens.weight"
    assert "lm_head.weight" in kept and embedding in kept
    assert not any(n.endswith(("norm.weight", "e_score_correction_bias", "shared_expert_gate.weight"))
                   for n, d in summary.plan.decisions.items() if d.quantize)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_scales_are_shared_by_fused_siblings(quantized, model_type):
    """Gate and up of every expert (and of dense/shared MLPs), and q/k/v, carry one scale; so do DBRX's
    fused w1 and v1, and the gate and up halves of a fused gate/up tensor."""
    _, dst, _ = quantized[model_type]
    after = read_all(dst)
    pairs = [(f".{a}.weight_scale", f".{b}.weight_scale") for a, b in
             [("w1", "w3"), ("gate_proj", "up_proj"), ("q_proj", "k_proj"), ("q_proj", "v_proj")]]
    pairs.append((".w1_weight_scale", ".v1_weight_scale"))
    checked = 0
    for name, scale in after.items():
        for a, b in pairs:
            sibling = name.removesuffix(a) + b
            if name.endswith(a) and sibling in after:  # MLA has a lone q_proj
                assert torch.equal(scale, after[sibling]), name
                checked += 1
        if name.endswith("input_linear.weight_scale") and scale.dim() == 2:
            assert torch.equal(scale[:, 0], scale[:, 1]), name
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("model_type", FAMILIES)
def test_config_carries_what_vllm_parses(quantized, model_type):
    src, dst, summary = quantized[model_type]
    config = json.loads((dst / "config.json").read_text())
    source_config = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == source_config
    qc = config["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["activation_scheme"] == "dynamic"
    after = read_all(dst)
    kept_linears = {n.removesuffix(".weight") for n, t in after.items()
                    if n.endswith(".weight") and t.dim() == 2 and t.dtype != torch.float8_e4m3fn
                    and "embed" not in n and not n.endswith(".wte.weight")}
    assert set(qc["ignored_layers"]) == kept_linears
    family = adapter_for(source_config)
    routers = {d.role.module for d in summary.plan.decisions.values()
               if d.role.kind == Kind.ROUTER and d.role.is_linear_weight}
    assert routers and routers <= set(qc["ignored_layers"]) and "lm_head" in qc["ignored_layers"], family.name


@pytest.mark.parametrize("model_type", FAMILIES)
def test_output_is_sharded_with_an_index_and_extra_files_copied(quantized, model_type):
    src, dst, summary = quantized[model_type]
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(summary.plan.shards) > 1
    on_disk = {}
    for file in files:
        with safe_open(dst / file, framework="pt") as f:
            on_disk.update(dict.fromkeys(f.keys(), file))
    assert on_disk == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in read_all(dst).values())
    for extra in ("generation_config.json", "tokenizer_config.json"):
        assert (dst / extra).read_bytes() == (src / extra).read_bytes()
    assert not list(dst.glob("*.partial"))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_stacked_view_of_src_equals_dequantized_stacked_view_of_dst(quantized, model_type):
    src, dst, summary = quantized[model_type]
    checks = check_expert_weights(src, dst)
    assert [c.layer for c in checks] == [m.layer for m in summary.plan.moe_layers] != []
    assert all(c.ok for c in checks), checks
    assert all(0 < c.relative_error < 0.05 for c in checks)


def test_experts_only_keeps_attention_and_dense_mlps(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("deepseek_v3")
    summary = quantize_checkpoint(src, tmp_path / "out", Options(experts_only=True, format="fp8", scheme="tensor"),
                                  show_progress=False)
    decisions = summary.plan.decisions
    for name, d in decisions.items():
        if d.role.kind in (Kind.ROUTED_EXPERT, Kind.SHARED_EXPERT):
            assert d.quantize, name
        else:
            assert not d.quantize, name
    assert any(d.role.kind == Kind.SHARED_EXPERT for d in decisions.values())
    ignored = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignored_layers"]
    assert "model.layers.0.self_attn.q_a_proj" in ignored and "model.layers.0.mlp.gate_proj" in ignored


def test_gate_and_up_in_different_shards(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("mixtral", max_shard_size="20KB")
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    gate, up = (f"model.layers.0.block_sparse_moe.experts.{{}}.{p}.weight" for p in ("w1", "w3"))
    assert any(weight_map[gate.format(e)] != weight_map[up.format(e)] for e in range(4))
    quantize_checkpoint(src, tmp_path / "out", show_progress=False)
    assert all(c.ok for c in check_expert_weights(src, tmp_path / "out"))


def test_single_file_checkpoint(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3_moe", max_shard_size="1GB")
    assert (src / "model.safetensors").exists() and not (src / "model.safetensors.index.json").exists()
    summary = quantize_checkpoint(src, tmp_path / "out", show_progress=False)
    assert summary.plan.shard_names == ["model.safetensors"]
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert all(c.ok for c in check_expert_weights(src, tmp_path / "out"))


def test_fused_expert_scales_have_the_shapes_vllm_loads(quantized):
    """vLLM's DBRX loader takes `[E]` per tensor; its Granite loaders split `input_linear.weight_scale`
    per expert into gate and up like the weight, so that one is `[E, 2]`."""
    dbrx = Checkpoint(quantized["dbrx"][1]).tensors
    for tensor in ("w1", "v1", "w2"):
        assert dbrx[f"transformer.blocks.1.ffn.experts.mlp.{tensor}_weight_scale"].shape == (4,)
    granite = Checkpoint(quantized["granitemoe"][1]).tensors
    assert granite["model.layers.1.block_sparse_moe.input_linear.weight_scale"].shape == (4, 2)
    assert granite["model.layers.1.block_sparse_moe.output_linear.weight_scale"].shape == (4,)


@pytest.mark.parametrize("model_type", ["granitemoe", "granitemoehybrid", "dbrx", "qwen3_next", "jamba"])
def test_dequantized_output_loads_in_transformers(quantized, model_type, tmp_path):
    """Fused experts are written back under their own names and layout, hybrids keep their mixers:
    transformers loads the bf16 copy of the output with no missing or unexpected tensor."""
    _, dst, _ = quantized[model_type]
    dequantize_checkpoint(dst, tmp_path / "bf16")
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
