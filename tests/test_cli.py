"""The command line: usage, reports, and one-sentence errors without tracebacks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from quantize_moe.cli.app import app
from quantize_moe.plan.options import GPU_WORKERS_PER_DEVICE

runner = CliRunner()


def invoke(*args):
    """In process with catch_exceptions=False: anything but a clean exit fails the test with its traceback."""
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def assert_user_error(result, *fragments, code=1):
    """One sentence, no traceback; exit 1 for bad input, 2 for a bad command line (see test_usage)."""
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    for fragment in fragments:
        assert fragment in " ".join(result.output.split()), result.output


def test_quantize_and_inspect(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen2_moe")
    result = invoke("inspect", src)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for fragment in ("Qwen2-MoE (qwen2_moe)", "MoE layers", "2: 0, 2", "4 (top-2)", "32 x 64", "router",
                     "shared_expert_gate", "routed expert", "quantized"):
        assert fragment in text, fragment
    result = invoke("quantize", src, tmp_path / "out", "--max-shard-size", "50KB", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "tensors quantized" in result.output
    # auto: 32 x 64 experts do not fit 128x128 blocks, so channel scales in compressed-tensors load most widely
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel"


@pytest.mark.parametrize("family", [(), ("--family", "llama4_text")])  # the default; experts written unfused
def test_demo_runs_offline(family):
    result = invoke("demo", *family)
    assert result.exit_code == 0, result.output
    assert "Routed experts: dequantized FP8 vs original" in result.output and "NO" not in result.output


@pytest.mark.parametrize("family", ["gpt_oss"])
def test_demo_offers_no_family_that_quantize_refuses(family):
    assert_user_error(invoke("demo", "--family", family), f"--family {family} has no demo checkpoint", "mixtral",
                      code=2)


def test_overwrite_keeps_files_it_did_not_write(tiny_checkpoint, tmp_path):
    """Refusals of a bad DST are in test_bad_inputs; --overwrite replaces only quantize-moe's own files."""
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    result = invoke("quantize", tiny_checkpoint("mixtral"), tmp_path / "busy", "--overwrite", "--no-progress")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_kept_weights_stay_bit_identical_through_the_cli(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("deepseek_v3", max_shard_size="1GB")
    assert invoke("quantize", src, tmp_path / "out", "--no-progress").exit_code == 0
    out = load_file(tmp_path / "out" / "model.safetensors")
    original = load_file(src / "model.safetensors")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert out[bias].dtype == original[bias].dtype and torch.equal(out[bias], original[bias])


@pytest.mark.parametrize("command, shown", [
    ("quantize", ["org/name@revision", f"{GPU_WORKERS_PER_DEVICE} per GPU"]),
    ("inspect", ["org/name@revision"]),
])
def test_help_shows_what_rich_markup_could_swallow(command, shown, monkeypatch):
    """Square brackets in help text read as rich markup tags and vanish; the help says it without them."""
    monkeypatch.setenv("COLUMNS", "400")  # one line per option, so phrases are not wrapped apart
    result = invoke(command, "--help")
    assert result.exit_code == 0
    for phrase in shown:
        assert phrase in result.output, phrase
