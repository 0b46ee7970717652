"""Static activation scales read, checked and applied: `read_quantization`, the fused-MoE layer's loader,
`verify`, `validate` and `evaluate` on static checkpoints built as llm-compressor lays them out."""

from __future__ import annotations

import shutil

import pytest
import torch

from static_checkpoint import edit_shards, make_static, measured_input_scales, static_scales

from quantize_moe.check.moe_layers import MoECheckpoint
from quantize_moe.check.streamed_eval import evaluate
from quantize_moe.check.validate import validate
from quantize_moe.check.verify import verify
from quantize_moe.errors import UserError
from quantize_moe.moe.layer import FusedMoE
from quantize_moe.moe.methods import method_for_spec
from quantize_moe.moe.reference import fused_experts_reference, quantize_weight
from quantize_moe.plan.options import Options
from quantize_moe.plan.plan import _check_source_not_done
from quantize_moe.quantization.formats import FORMATS, read_quantization
from quantize_moe.quantization.schemes import SCHEMES
from quantize_moe.quantization.spec import MoEQuantSpec
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.tiny import build_tiny_checkpoint
from quantize_moe.write.job import quantize_checkpoint

STATIC = MoEQuantSpec("tensor", "static")
EXPERT = "model.layers.1.block_sparse_moe.experts.2"


def _compressed(weights: str, activations: dict | None) -> dict:
    weight = {"num_bits": 8, "type": "float", "strategy": weights, "dynamic": False,
              "block_structure": [128, 128] if weights == "block" else None}
    return {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": weight, "input_activations": activations}}}}


def _activations(dynamic, strategy, group_size=None) -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": dynamic, "strategy": strategy,
            "group_size": group_size}


@pytest.mark.parametrize("config, spec", [
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, STATIC),
    (_compressed("tensor", _activations(False, "tensor")), STATIC),
    (_compressed("tensor", _activations(True, "tensor")), MoEQuantSpec("tensor", "tensor")),
    (_compressed("tensor", _activations(True, "token")), MoEQuantSpec("tensor", "token")),
    (_compressed("channel", _activations(True, "token")), MoEQuantSpec("channel", "token")),
    (_compressed("block", _activations(True, "group", 128)), MoEQuantSpec("block", "group", (128, 128))),
], ids=["native-static", "ct-static", "ct-dynamic-tensor", "ct-dynamic-token", "ct-channel", "ct-block-group"])
def test_read_quantization_keeps_the_input_activations(config, spec):
    assert read_quantization(config, "'config.json'")[0] == spec


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_a_source_made_with_the_options_asked_for_is_nothing_to_do_and_no_other_is(fmt):
    """Static activations and the FP8 KV cache are part of what an output is: the same job only with the same ones."""
    runs = [Options(scheme="tensor", format=fmt, activations=activations, kv_cache=kv)
            for activations in ("dynamic", "static") for kv in (None, "fp8")]
    for made in runs:
        raw = {"quantization_config": FORMATS[fmt].quantization_config(
            SCHEMES["tensor"], ["lm_head"], ["model.layers.0.mlp.experts.0.w1"], made.activations, made.kv_cache == "fp8")}
        for asked in runs:
            if asked == made:
                with pytest.raises(UserError, match="nothing to do"):
                    _check_source_not_done(raw, asked, "'config.json'")
            else:
                _check_source_not_done(raw, asked, "'config.json'")  # another job: requantize it


@pytest.mark.parametrize("config, fragment", [
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                              "weight_block_size": [128, 128]}}, "block weights with static activations"),
    (_compressed("channel", _activations(False, "tensor")), "channel weights with static activations"),
    (_compressed("tensor", _activations(False, "token")), "static input activations with strategy 'token'"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "calibrated"}}, "'dynamic' or 'static'"),
])
def test_static_activations_no_engine_runs_are_one_sentence(config, fragment):
    with pytest.raises(UserError, match=fragment):
        read_quantization(config, "'config.json'")


def _static_layer(w13_inputs, w2_inputs) -> FusedMoE:
    """A 3-expert static FusedMoE loaded through its weight loader like a checkpoint's experts."""
    experts, hidden, inter = 3, 32, 16
    moe = FusedMoE(experts, hidden, inter, method_for_spec(STATIC), name="layer 0")
    params = dict(moe.named_parameters())
    w13, w13_scale = quantize_weight(torch.randn(experts, 2 * inter, hidden), STATIC)
    w2, w2_scale = quantize_weight(torch.randn(experts, hidden, inter), STATIC)
    for e in range(experts):
        for shard, rows in (("w1", slice(0, inter)), ("w3", slice(inter, None))):
            moe.weight_loader(params["w13_weight"], w13[e, rows], "w13_weight", shard, e)
            moe.weight_loader(params["w13_weight_scale"], w13_scale[e], "w13_weight_scale", shard, e)
            moe.weight_loader(params["w13_input_scale"], torch.tensor(w13_inputs[e][shard == "w3"]),
                              "w13_input_scale", shard, e)
        moe.weight_loader(params["w2_weight"], w2[e], "w2_weight", "w2", e)
        moe.weight_loader(params["w2_weight_scale"], w2_scale[e], "w2_weight_scale", "w2", e)
        moe.weight_loader(params["w2_input_scale"], torch.tensor(w2_inputs[e]), "w2_input_scale", "w2", e)
    moe.process_weights_after_loading()
    return moe


def test_layer_reduces_expert_input_scales_to_their_max_and_applies_them():
    moe = _static_layer([(0.01, 0.01), (0.03, 0.03), (0.02, 0.02)], [0.002, 0.001, 0.004])
    assert moe.w13_input_scale.tolist() == [torch.tensor(0.03).item()]
    assert moe.w2_input_scale.tolist() == [torch.tensor(0.004).item()]
    x, ids = torch.randn(8, 32), torch.randint(0, 3, (8, 2))
    weights = torch.softmax(torch.randn(8, 2), -1)
    out = moe(x, weights, ids)
    expected = fused_experts_reference(x, moe.w13_weight, moe.w2_weight, weights, ids, quant=STATIC,
                                       w13_scale=moe.w13_weight_scale, w2_scale=moe.w2_weight_scale,
                                       a13_scale=torch.tensor([0.03]), a2_scale=torch.tensor([0.004]))
    assert torch.equal(out, expected)
    tiny = fused_experts_reference(x, moe.w13_weight, moe.w2_weight, weights, ids, quant=STATIC,
                                   w13_scale=moe.w13_weight_scale, w2_scale=moe.w2_weight_scale,
                                   a13_scale=torch.tensor([1e-5]), a2_scale=torch.tensor([0.004]))
    assert not torch.allclose(out, tiny)


@pytest.mark.parametrize("w13_inputs, w2_inputs, fragment", [
    ([(0.01, 0.01), (0.03, 0.02), (0.02, 0.02)], [0.1] * 3, "expert 1 has input scales 0.03"),
    ([(0.01, 0.01)] * 3, [0.1, float("nan"), 0.1], "expert 1's w2_input_scale is nan"),
    ([(0.01, 0.01), (0.0, 0.0), (0.01, 0.01)], [0.1] * 3, "expert 1's w13_input_scale is 0;"),
])
def test_layer_refuses_disagreeing_or_broken_input_scales(w13_inputs, w2_inputs, fragment):
    with pytest.raises(UserError, match=fragment):
        _static_layer(w13_inputs, w2_inputs)


@pytest.fixture(scope="module")
def static_pair(tmp_path_factory):
    """SRC, its per-tensor FP8 output with measured static scales (native fp8 and compressed-tensors),
    and the tokens the scales and the evaluate tests use."""
    root = tmp_path_factory.mktemp("static")
    src = build_tiny_checkpoint("mixtral", root / "src")
    batches = [row[None] for row in torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))]
    measured = measured_input_scales(src, batches)
    for fmt in ("fp8", "compressed-tensors"):
        quantize_checkpoint(src, root / fmt, Options(format=fmt, scheme="tensor", max_shard_size=200_000),
                            show_progress=False)
        make_static(root / fmt, static_scales(root / fmt, measured))
    return root, batches


def _edited(folder, tmp_path, edit):
    """A copy of `folder` with `edit(tensors)` applied to every shard."""
    copy = shutil.copytree(folder, tmp_path / folder.name)
    edit_shards(copy, edit)
    return copy


def _failures(report) -> str:
    return " ".join(" ".join([f.message, *f.examples]) for f in report.findings if f.status == "fail")


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_verify_passes_a_static_checkpoint_and_names_each_broken_input_scale(static_pair, fmt, tmp_path):
    root, _ = static_pair
    assert verify(root / fmt, Checkpoint(root / "src")).ok
    attention = "model.layers.0.self_attn.o_proj.input_scale"

    def damage(tensors):
        if f"{EXPERT}.w2.input_scale" in tensors:
            tensors["model.layers.0.input_layernorm.input_scale"] = tensors.pop(f"{EXPERT}.w2.input_scale")
        for name, value in ((f"{EXPERT}.w1.input_scale", float("nan")), (attention, 0.0)):
            if name in tensors:
                tensors[name] = torch.full_like(tensors[name], value)

    report = verify(_edited(root / fmt, tmp_path, damage))
    failures = _failures(report)
    assert not report.ok
    assert f"'{EXPERT}.w2.input_scale' is missing, but the config declares static activations" in failures
    assert f"'{EXPERT}.w1.input_scale' holds NaN or Inf" in failures
    assert f"'{attention}' holds a zero or negative scale" in failures
    assert "scale 'model.layers.0.input_layernorm.input_scale' belongs to no FP8 weight" in failures


def test_verify_refuses_a_static_checkpoint_missing_every_expert_input_scale(static_pair, tmp_path):
    root, _ = static_pair
    copy = _edited(root / "compressed-tensors", tmp_path, lambda t: [t.pop(n) for n in list(t)
                                                                       if "experts" in n and n.endswith("input_scale")])
    deleted = [n for n in Checkpoint(root / "compressed-tensors").tensors if "experts" in n and "input_scale" in n]
    report = verify(copy)
    metadata = next(f for f in report.findings if f.check == "metadata")
    assert metadata.status == "fail" and metadata.message.startswith(f"{len(deleted)} ") and len(deleted) == 24


def _expert_input_scales_to(value):
    def edit(tensors):
        for name in tensors:
            if "experts" in name and name.endswith("input_scale"):
                tensors[name] = torch.full_like(tensors[name], value)
    return edit


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_validate_applies_the_static_scales(static_pair, fmt, tmp_path):
    root, _ = static_pair
    good = validate(root / "src", root / fmt)
    assert good.passed, [(r.layer, r.relative_error) for r in good.layers]
    assert MoECheckpoint.open(root / fmt).spec == STATIC
    bad = validate(root / "src", _edited(root / fmt, tmp_path, _expert_input_scales_to(1e-5)))
    assert not any(layer.passed for layer in bad.layers)
    assert min(layer.relative_error for layer in bad.layers) > 0.5


def test_evaluate_applies_the_static_scales(static_pair, tmp_path):
    root, batches = static_pair
    good = evaluate(root / "src", root / "fp8", batches)
    bad = evaluate(root / "src", _edited(root / "fp8", tmp_path, _expert_input_scales_to(1e-5)), batches)
    assert good.mean_kl < 0.05 and good.top1_agreement > 0.7
    assert bad.mean_kl > 10 * good.mean_kl and bad.top1_agreement < good.top1_agreement - 0.3
