"""`quantize-moe validate`: passes good checkpoints (ours and foreign), fails broken ones."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from moe_blocks import expert_call

from quantize_moe.quantization import fp8
from quantize_moe.adapters import adapter_for
from quantize_moe.cli.app import app
from quantize_moe.errors import UserError
from quantize_moe.check.moe_layers import MoECheckpoint
from quantize_moe.plan.options import Options
from quantize_moe.write.job import quantize_checkpoint
from quantize_moe.source.tiny import TINY_CONFIGS
from quantize_moe.check.validate import validate
from quantize_moe.moe.routing import route
from quantize_moe.quantization.spec import MoEQuantSpec

runner = CliRunner()
EXPERT = "model.layers.1.block_sparse_moe.experts.{e}.{p}.{t}"


@pytest.fixture(scope="module")
def mixtral_pair(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("mixtral", max_shard_size="1GB")
    dst = tmp_path_factory.mktemp("fp8") / "out"
    # per-tensor native fp8: the foreign-checkpoint test below rewrites its per-expert scales
    quantize_checkpoint(src, dst, Options(format="fp8", scheme="tensor"), show_progress=False)
    return src, dst


def edited_copy(dst, tmp_path, edit):
    """A copy of the single-file checkpoint `dst` with `edit(tensors)` applied."""
    out = tmp_path / "edited"
    shutil.copytree(dst, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_good_checkpoint_passes_with_json_report(mixtral_pair, tmp_path):
    src, dst = mixtral_pair
    result = runner.invoke(app, ["validate", str(src), str(dst), "--json", str(tmp_path / "report.json"),
                                 "--tokens", "300"])
    assert result.exit_code == 0, result.output
    assert "torch reference" in result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and [r["layer"] for r in report["layers"]] == [0, 1]
    for layer in report["layers"]:
        assert layer["tokens"] == 300 and layer["experts_with_tokens"] == 4
        assert 0.01 < layer["relative_error"] < 0.1 and layer["cosine"] > 0.99
        assert layer["fp8_kernel_error"] < 0.01 and layer["quantization_error"] > 0.01


@pytest.mark.parametrize("breakage", ["scale", "swapped experts", "gate and up swapped"])
def test_broken_checkpoints_fail(mixtral_pair, tmp_path, breakage):
    src, dst = mixtral_pair

    def edit(tensors):
        if breakage == "scale":
            tensors[EXPERT.format(e=2, p="w2", t="weight_scale")] *= 4
        elif breakage == "swapped experts":
            a, b = EXPERT.format(e=0, p="w2", t="weight"), EXPERT.format(e=3, p="w2", t="weight")
            tensors[a], tensors[b] = tensors[b], tensors[a]
        else:
            a, b = EXPERT.format(e=1, p="w1", t="weight"), EXPERT.format(e=1, p="w3", t="weight")
            tensors[a], tensors[b] = tensors[b], tensors[a]

    result = runner.invoke(app, ["validate", str(src), str(edited_copy(dst, tmp_path, edit)), "--layers", "0,1"])
    assert result.exit_code == 3, result.output
    assert "validation failed in layer(s) 1" in " ".join(result.output.split())


def test_foreign_checkpoint_with_separate_gate_up_scales_passes(mixtral_pair, tiny_checkpoint, tmp_path):
    """AutoFP8 / llm-compressor write one scale per projection: the layer max-requantizes w13."""
    src, dst = mixtral_pair
    original = load_file(src / "model.safetensors")

    def requantize_up_alone(tensors):
        for e in range(4):
            name = EXPERT.format(e=e, p="w3", t="weight")
            scale = fp8.scale_from_amax(fp8.amax(original[name], name))
            tensors[name] = fp8.quantize(original[name], scale)
            tensors[EXPERT.format(e=e, p="w3", t="weight_scale")] = scale

    report = validate(src, edited_copy(dst, tmp_path, requantize_up_alone), tokens=200)
    assert report.passed, report.layers


def test_real_hidden_states_from_a_file(mixtral_pair, tmp_path):
    src, dst = mixtral_pair
    save_file({"hidden_states": torch.randn(37, 64).bfloat16()}, tmp_path / "h.safetensors")
    report = validate(src, dst, hidden_states_file=tmp_path / "h.safetensors")
    assert report.passed and {r.tokens for r in report.layers} == {37}
    save_file({"other": torch.randn(3, 64)}, tmp_path / "bad.safetensors")
    result = runner.invoke(app, ["validate", str(src), str(dst), "--hidden-states", str(tmp_path / "bad.safetensors")])
    assert result.exit_code == 1 and "neither 'layers.0' nor 'hidden_states'" in " ".join(result.output.split())


WRITTEN = [t for t in sorted(TINY_CONFIGS) if not adapter_for({"model_type": t}).fp8_refusal]


@pytest.mark.parametrize("model_type", WRITTEN)
def test_every_family_quantize_writes_passes(model_type, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(model_type)
    quantize_checkpoint(src, tmp_path / "fp8", show_progress=False)
    report = validate(src, tmp_path / "fp8", tokens=128)
    assert report.layers and report.passed, report.layers
    assert all(0.01 < r.relative_error and r.experts_with_tokens > 1 for r in report.layers)
    moe = MoECheckpoint.open(src)  # drawn hidden states get the RMS of the norm in front of the block
    assert all(moe.family.layer_tensor(moe.checkpoint.tensors, layer, rf"{moe.family.moe_input_norm}\.weight")
               for layer in moe.layers)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "deepseek_v3", "llama4_text"])
def test_validate_bf16_path_equals_transformers_moe_block(model_type, tiny_checkpoint):
    """The side validate measures FP8 against (its routing, then the layer it loads from SRC) gives what
    transformers' own MoE block gives its experts, not just what the same code gives in float64. For
    Llama-4 transformers runs every expert on router-scaled inputs and sums; top-1 sigmoid weights make
    the unchosen ones zero."""
    src = tiny_checkpoint(model_type)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    moe = MoECheckpoint.open(src)
    torch.manual_seed(2)
    for layer in moe.layers:
        hidden = torch.randn(1, 29, moe.layers[layer].hidden_size)
        _, theirs = expert_call(model, layer, hidden)
        router = moe.load_router(layer)
        x, weights, ids = route(hidden[0], router, moe.family.routing_rule(moe.config, router, layer))
        with torch.no_grad():
            ours = moe.load_layer(layer, params_dtype=torch.float32)(x, weights, ids)
        if model_type == "llama4_text":
            theirs = theirs.reshape(moe.layers[layer].num_experts, *ours.shape).sum(dim=0)
        torch.testing.assert_close(ours, theirs.reshape(ours.shape), rtol=1e-5, atol=1e-5)


def test_llama4_router_weight_scales_the_expert_input(tiny_checkpoint, tmp_path):
    """quantize writes Llama-4's fused experts one Linear per expert (what vLLM loads); validate reads
    the fused bf16 SRC and that per-expert DST side by side. That its bf16 side matches transformers'
    Llama-4 block is pinned above; here the FP8 side must be within FP8 error of it."""
    src = tiny_checkpoint("llama4_text")
    quantize_checkpoint(src, tmp_path / "fp8", show_progress=False)
    dst = MoECheckpoint.open(tmp_path / "fp8")
    assert {dst.family.role(n, 2).fused for n in dst.checkpoint.tensors} == {None}
    report = validate(src, tmp_path / "fp8", tokens=128)
    assert report.layers and report.passed, report.layers
    assert all(0.01 < r.relative_error < 0.1 for r in report.layers), report.layers


def test_validate_simulates_the_activations_the_config_declares(mixtral_pair, tmp_path):
    """compressed-tensors with tensor weights declares one dynamic scale per tensor for activations,
    and validate quantizes them so; a config declaring per-token activations gets per token."""
    src, _ = mixtral_pair
    quantize_checkpoint(src, tmp_path / "ct", Options(format="compressed-tensors", scheme="tensor"),
                        show_progress=False)
    declared = MoECheckpoint.open(tmp_path / "ct")
    assert declared.load_layer(1).quant_method.spec == MoEQuantSpec("tensor", "tensor")
    with pytest.raises(UserError, match="nothing to do"):  # already in the format and scheme asked for
        quantize_checkpoint(tmp_path / "ct", tmp_path / "again", Options(format="compressed-tensors", scheme="tensor"),
                            show_progress=False)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["strategy"] = "token"
    (tmp_path / "ct" / "config.json").write_text(json.dumps(config))
    assert MoECheckpoint.open(tmp_path / "ct").load_layer(1).quant_method.spec == MoEQuantSpec("tensor", "token")


def test_gpt_oss_refused(tiny_checkpoint):
    src = tiny_checkpoint("gpt_oss")
    result = runner.invoke(app, ["validate", str(src), str(src)])
    assert result.exit_code == 1
    assert "gpt-oss checkpoint, which validate cannot check" in " ".join(result.output.split())


def test_a_layer_read_ahead_gives_what_reading_it_in_turn_gives(mixtral_pair):
    """On a GPU validate reads the next layer while one runs and hands it over as a future (`loaded`);
    the layer's result must not depend on which way its experts arrived."""
    from concurrent.futures import Future

    from quantize_moe.check.thresholds import Thresholds
    from quantize_moe.check.validate import validate_layer

    source, produced = (MoECheckpoint.open(folder) for folder in mixtral_pair)
    x = torch.randn(32, source.layers[0].hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    loaded = Future()
    loaded.set_result((source.load_layer(0), produced.load_layer(0)))
    args = dict(device=torch.device("cpu"), reference_dtype=torch.float64, thresholds=Thresholds())
    assert validate_layer(source, produced, 0, x, loaded=loaded, **args) == validate_layer(source, produced, 0, x, **args)
