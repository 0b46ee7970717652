"""The generic adapter: tiny checkpoints of known families with model_type (and names) rewritten to
something unknown must quantize exactly as their own adapter does, and only with --adapter generic."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.locations import CONFIG_NAME, INDEX_NAME
from quantize_moe.cli.app import app
from quantize_moe.plan.plan import make_plan
from quantize_moe.plan.options import Options
from quantize_moe.write.job import quantize_checkpoint
from quantize_moe.check.validate import validate

UNKNOWN = "mystery_moe"
SHARDED = 60_000  # a few output shards, so the index is compared too


def disguise(src: Path, dst: Path, rename=lambda name: name, **config) -> Path:
    """A copy of `src` with model_type UNKNOWN (and `config` updates) whose tensors are renamed by `rename`."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / CONFIG_NAME).read_text())
    (dst / CONFIG_NAME).write_text(json.dumps({**raw, "model_type": UNKNOWN, **config}))
    for shard in Checkpoint(dst).shard_files:
        tensors = load_file(dst / shard)
        save_file({rename(n): t for n, t in tensors.items()}, dst / shard, metadata={"format": "pt"})
    if (dst / INDEX_NAME).is_file():
        index = json.loads((dst / INDEX_NAME).read_text())
        index["weight_map"] = {rename(n): f for n, f in index["weight_map"].items()}
        (dst / INDEX_NAME).write_text(json.dumps(index))
    return dst


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)  # a crash fails here
    return result, " ".join(result.output.split())


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_generic_output_is_the_family_adapters_byte_for_byte(tiny_checkpoint, tmp_path, model_type):
    src = tiny_checkpoint(model_type, max_shard_size="100KB")
    real, generic = tmp_path / "real", tmp_path / "generic"
    quantize_checkpoint(src, real, Options(max_shard_size=SHARDED), show_progress=False)
    quantize_checkpoint(disguise(src, tmp_path / "src"), generic, Options(max_shard_size=SHARDED, adapter="generic"),
                        show_progress=False)
    weights = sorted(p.name for p in real.glob("*.safetensors*"))
    assert len(weights) > 2 and weights == sorted(p.name for p in generic.glob("*.safetensors*"))
    for name in weights:
        assert (real / name).read_bytes() == (generic / name).read_bytes(), name
    config = json.loads((generic / CONFIG_NAME).read_text())
    assert config.pop("model_type") == UNKNOWN
    assert config == {k: v for k, v in json.loads((real / CONFIG_NAME).read_text()).items() if k != "model_type"}


def test_other_prefix_and_names_quantize_like_the_family(tiny_checkpoint, tmp_path):
    """Decoder prefix, experts block and projections renamed: gate/up told by name, down by its shape."""
    src = tiny_checkpoint("qwen2_moe")
    names = {"gate_proj": "wi_gate", "up_proj": "wi_up", "down_proj": "wo"}

    def rename(name: str) -> str:
        name = re.sub(r"^model\.layers\.", "transformer.h.", name).replace(".mlp.", ".moe.")
        return re.sub(r"(experts\.\d+\.)(\w+)", lambda m: m[1] + names[m[2]], name)

    quantize_checkpoint(src, tmp_path / "real", Options(), show_progress=False)
    disguised = disguise(src, tmp_path / "src", rename)
    plan = make_plan(Checkpoint(disguised), Options(adapter="generic"))
    assert plan.family.projections == {"wi_gate": "w1", "wi_up": "w3", "wo": "w2"}
    quantize_checkpoint(disguised, tmp_path / "generic", Options(adapter="generic"), show_progress=False)
    real = load_file(tmp_path / "real" / "model.safetensors")
    generic = load_file(tmp_path / "generic" / "model.safetensors")
    assert generic.keys() == {rename(n) for n in real}
    for name, tensor in real.items():
        assert generic[rename(name)].dtype == tensor.dtype and generic[rename(name)].equal(tensor), name


def test_inspect_shows_the_generic_reading_and_quantize_needs_the_option(tiny_checkpoint, tmp_path):
    src = disguise(tiny_checkpoint("qwen2_moe"), tmp_path / "src")
    result, text = invoke("inspect", src)
    assert result.exit_code == 0, result.output
    for fragment in ("generic: model.layers.{L}.mlp.experts.{j}.gate_proj/up_proj/down_proj as gate/up/down",
                     "router mlp.gate", f"({UNKNOWN})", "2: 0, 2", "4 (top-2)", "32 x 64",
                     "shared_expert_gate: a 1-row gate", "shared expert", "router", "--adapter generic"):
        assert fragment in text, fragment
    result, text = invoke("quantize", src, tmp_path / "dst", "--no-progress")
    assert result.exit_code == 1 and "pass --adapter generic" in text
    assert not (tmp_path / "dst").exists()


def test_validate_and_verify_read_the_output_with_the_option(tiny_checkpoint, tmp_path):
    src = disguise(tiny_checkpoint("qwen3_moe"), tmp_path / "src")
    dst = tmp_path / "dst"
    result, _ = invoke("quantize", src, dst, "--adapter", "generic", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "--adapter generic" in json.loads((dst / "quantize_moe_run.json").read_text())["command"]
    report = validate(src, dst, tokens=64, device="cpu", adapter="generic")
    assert report.passed
    assert report.routing_note.startswith("the generic adapter guesses the routing: softmax top-k, renormalized")
    result, text = invoke("verify", dst, "--against", src, "--adapter", "generic")
    assert result.exit_code == 0, result.output
    result, text = invoke("verify", dst)
    assert result.exit_code == 3 and "pass --adapter generic" in text


def _unrecognised(name: str) -> str:
    return name.replace(".experts.", ".mlps.")


def _ambiguous(name: str) -> str:
    return name.replace("gate_proj", "a_proj").replace("up_proj", "b_proj")


@pytest.mark.parametrize("rename, config, fragments", [
    (_unrecognised, {}, ["does not support", "recognises no per-expert MoE layout", "supported families:",
                         "mixtral", "qwen3_moe", "docs/adding-a-family.md"]),
    (_ambiguous, {}, ["a_proj and b_proj do not say which is gate and which is up", "docs/adding-a-family.md"]),
    (lambda name: name, {"num_experts": 16},
     ["num_experts 16", "the expert tensors of layer 0 show experts 8", "does not belong to these weights"]),
    (lambda name: name, {"moe_intermediate_size": 48}, ["moe_intermediate_size 48", "expert width 32"]),
])
def test_refusals_name_the_reason(tiny_checkpoint, tmp_path, rename, config, fragments):
    src = disguise(tiny_checkpoint("qwen3_moe"), tmp_path / "src", rename, **config)
    for command in (("inspect", src), ("quantize", src, tmp_path / "dst", "--adapter", "generic")):
        result, text = invoke(*command)
        assert result.exit_code == 1, result.output
        for fragment in fragments:
            assert fragment in text, (fragment, text)
    assert not (tmp_path / "dst").exists()


def test_an_unknown_adapter_is_refused(tiny_checkpoint, tmp_path):
    result, text = invoke("quantize", tiny_checkpoint("mixtral"), tmp_path / "dst", "--adapter", "magic")
    assert result.exit_code == 2 and "--adapter magic is not available; choose generic" in text  # bad usage
