"""An FP8 KV cache read back: `verify` requires a finite positive k_scale and v_scale for every attention
layer of a checkpoint declaring `kv_cache_scheme` (and reports ones nothing declares), and `evaluate`
rounds the cached keys and values through FP8 with them, so wrong scales show in its numbers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers.utils import logging as transformers_logging
from typer.testing import CliRunner

from static_checkpoint import edit_shards

from quantize_moe.check.streamed_eval import evaluate
from quantize_moe.check.verify import verify
from quantize_moe.cli.app import app
from quantize_moe.errors import UserError
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.tiny import build_tiny_checkpoint
from quantize_moe.write.destination import MANIFEST_NAME

IDS = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))
ATTENTION = "model.layers.1.self_attn"


@pytest.fixture(scope="module")
def kv_pair(tmp_path_factory):
    """SRC (tiny Mixtral) and its `--kv-cache fp8` outputs in both formats, calibrated on IDS."""
    transformers_logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("kv")
    src = build_tiny_checkpoint("mixtral", root / "src")
    save_file({"input_ids": IDS}, root / "ids.safetensors")
    for fmt in ("fp8", "compressed-tensors"):
        result = CliRunner().invoke(app, ["quantize", str(src), str(root / fmt), "--no-progress", "--format", fmt,
                                          "--scheme", "tensor", "--kv-cache", "fp8", "--calibration",
                                          str(root / "ids.safetensors"), "--calibration-length", str(IDS.shape[1])])
        assert result.exit_code == 0, result.output
    return root


def _copy(folder, tmp_path, edit=None, config=None):
    """A copy of `folder` with `edit(tensors)` applied to its shards and `config(quantization_config)` to
    its config, without the manifest (the files changed, as a foreign tool's would): only what the edit
    broke can fail."""
    copy = shutil.copytree(folder, tmp_path / folder.name)
    (copy / MANIFEST_NAME).unlink()
    if edit:
        edit_shards(copy, edit)
    if config:
        whole = json.loads((copy / "config.json").read_text())
        config(whole["quantization_config"])
        (copy / "config.json").write_text(json.dumps(whole))
    return copy


def _failures(report) -> dict[str, str]:
    return {f.check: " ".join([f.message, *f.examples]) for f in report.findings if f.status == "fail"}


def _set(name, value):
    def edit(tensors):
        tensors[name] = torch.full_like(tensors[name], value)
    return edit


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_verify_against_the_source_passes_a_kv_cache_output(kv_pair, fmt):
    report = verify(kv_pair / fmt, Checkpoint(kv_pair / "src"))
    assert report.ok, _failures(report)
    metadata = next(f for f in report.findings if f.check == "metadata")
    assert "FP8 KV cache scales for 2 attention modules" in metadata.message
    assert any(f.check == "numerics: experts" and f.status == "pass" for f in report.findings)


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
@pytest.mark.parametrize("edit, check, sentence", [
    (lambda t: t.pop(f"{ATTENTION}.k_scale"), "metadata",
     f"'{ATTENTION}.k_scale' is missing, but the config declares an FP8 KV cache (kv_cache_scheme)"),
    (_set(f"{ATTENTION}.v_scale", float("nan")), "scales", f"'{ATTENTION}.v_scale' holds NaN or Inf"),
    (_set(f"{ATTENTION}.k_scale", 0.0), "scales", f"'{ATTENTION}.k_scale' holds a zero or negative scale"),
    (lambda t: t.__setitem__("model.layers.0.block_sparse_moe.k_scale", torch.tensor(0.1)), "metadata",
     "'model.layers.0.block_sparse_moe.k_scale' is a KV-cache scale beside no attention module"),
], ids=["deleted", "nan", "zero", "beside-no-attention"])
def test_verify_names_each_broken_kv_scale(kv_pair, fmt, edit, check, sentence, tmp_path):
    broken = _copy(kv_pair / fmt, tmp_path, edit)
    for source in (None, Checkpoint(kv_pair / "src")):  # plain verify, and verify --against SRC
        failures = _failures(verify(broken, source))
        assert failures.keys() == {check} and sentence in failures[check], failures


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_verify_reports_kv_scales_no_config_declares(kv_pair, fmt, tmp_path):
    undeclared = _copy(kv_pair / fmt, tmp_path, config=lambda qc: qc.__setitem__("kv_cache_scheme", None))
    failures = _failures(verify(undeclared, Checkpoint(kv_pair / "src")))
    assert failures.keys() == {"metadata"}, failures
    assert f"'{ATTENTION}.k_scale' is a KV-cache scale, but the config declares no kv_cache_scheme" in \
        failures["metadata"]
    assert failures["metadata"].startswith("4 ")  # k and v of both layers


def test_verify_refuses_a_kv_cache_scheme_it_cannot_run(kv_pair, tmp_path):
    per_head = _copy(kv_pair / "compressed-tensors", tmp_path,
                     config=lambda qc: qc["kv_cache_scheme"].__setitem__("strategy", "attn_head"))
    failures = _failures(verify(per_head))
    assert "kv_cache_scheme" in failures["metadata"] and "static per-tensor FP8 KV cache" in failures["metadata"]


def _batches():
    return [row[None] for row in IDS]


def test_evaluate_rounds_the_kv_cache_with_its_scales(kv_pair, tmp_path):
    good = evaluate(kv_pair / "src", kv_pair / "fp8", _batches())

    def shrink(tensors):
        for name in [n for n in tensors if n.endswith(".k_scale")]:
            tensors[name] = tensors[name] / 100

    bad = evaluate(kv_pair / "src", _copy(kv_pair / "fp8", tmp_path, shrink), _batches())
    assert good.mean_kl < 0.05 and good.top1_agreement > 0.7, good  # a random tiny model: FP8 weights alone cost this
    # near-uniform predictions of a random model: its perplexity hardly moves, its distributions do
    assert bad.mean_kl > 10 * good.mean_kl and bad.top1_agreement < good.top1_agreement - 0.3, (good, bad)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(f"{ATTENTION}.v_scale"), f"declares an FP8 KV cache but has no '{ATTENTION}.v_scale'"),
    (_set(f"{ATTENTION}.k_scale", float("nan")), f"'{ATTENTION}.k_scale' is nan; .* finite and positive"),
], ids=["missing", "nan"])
def test_evaluate_refuses_a_declared_kv_cache_without_usable_scales(kv_pair, edit, message, tmp_path):
    with pytest.raises(UserError, match=message):
        evaluate(kv_pair / "src", _copy(kv_pair / "compressed-tensors", tmp_path, edit), _batches())
