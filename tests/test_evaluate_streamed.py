"""`quantize-moe evaluate`: both models streamed over the same tokens, thresholds, bad data."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from quantize_moe.adapters.reader import SourceReader
from quantize_moe.check.streamed_eval import evaluate
from quantize_moe.cli.app import app
from quantize_moe.errors import UserError
from quantize_moe.plan.options import Options
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.tiny import build_tiny_checkpoint
from quantize_moe.write.job import quantize_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    src = build_tiny_checkpoint("mixtral", root / "src")
    quantize_checkpoint(src, root / "dst", Options(), show_progress=False)
    ids = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, root / "ids.safetensors")
    return root


def _run(root, *extra):
    return runner.invoke(app, ["evaluate", str(root / "src"), str(root / "dst"), "--data",
                               str(root / "ids.safetensors"), *extra])


def test_fp8_against_itself_and_against_the_original(pair):
    result = _run(pair, "--json", "-", "--min-top1", "0.8")  # a random tiny model has near-ties
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["tokens"] == 4 * 32
    assert 0.98 < report["perplexity_ratio"] < 1.02 and report["perplexity_ratio"] != 1.0
    assert 0 < report["mean_kl"] < 0.05 and report["top1_agreement"] > 0.8
    same = runner.invoke(app, ["evaluate", str(pair / "src"), str(pair / "src"), "--data",
                               str(pair / "ids.safetensors"), "--json", "-"])
    assert json.loads(same.output)["mean_kl"] == 0 and json.loads(same.output)["top1_agreement"] == 1


def test_failed_threshold_exits_3(pair):
    assert _run(pair, "--min-top1", "1.01").exit_code == 3


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    (b"not safetensors", "not a readable safetensors"),
    ({"input_ids": torch.full((2, 8), 500)}, "outside the vocabulary"),
    ({"other": torch.zeros(2, 8, dtype=torch.long)}, "needs a non-empty integer tensor"),
])
def test_bad_data_is_one_sentence(pair, tmp_path, content, message):
    data = tmp_path / "data.safetensors"
    if isinstance(content, bytes):
        data.write_bytes(content)
    elif content is not None:
        save_file(content, data)
    result = runner.invoke(app, ["evaluate", str(pair / "src"), str(pair / "dst"), "--data", str(data)])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_llama4_written_per_expert_runs_in_transformers_fused_modules(pair, tmp_path):
    """Our Llama-4 output has one Linear per expert (what vLLM reads); transformers' Llama-4 holds fused
    experts, which the reader joins back: each the source's within FP8 rounding, and evaluate runs it."""
    src = build_tiny_checkpoint("llama4_text", tmp_path / "src")
    quantize_checkpoint(src, tmp_path / "dst", Options(), show_progress=False)
    original, produced = SourceReader(Checkpoint(src)), SourceReader(Checkpoint(tmp_path / "dst"))
    fused = {name for name in produced.model_names if name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert fused == {name for name in original.names if name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert not any(".experts.0." in name for name in produced.model_names)
    for name in fused:
        want, got = original.get(name).float(), produced.get(name).float()
        assert got.shape == want.shape and (got - want).norm() / want.norm() < 0.05, name
    result = runner.invoke(app, ["evaluate", str(src), str(tmp_path / "dst"), "--data", str(pair / "ids.safetensors"),
                                 "--json", "-", "--min-top1", "0.8"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert 0.98 < report["perplexity_ratio"] < 1.02 and report["perplexity_ratio"] != 1.0
    assert 0 < report["mean_kl"] < 0.05 and len(report["layers"]) == 2


def test_a_refusal_closes_both_checkpoints(pair, tmp_path, monkeypatch):
    """A DST of another layer count is refused after both are open: neither is left open."""
    build_tiny_checkpoint("mixtral", tmp_path / "deeper", num_hidden_layers=3)
    closed = []
    monkeypatch.setattr(Checkpoint, "close", lambda self: closed.append(self.folder.name))
    with pytest.raises(UserError, match="decoder layers"):
        evaluate(pair / "src", tmp_path / "deeper", [torch.zeros(1, 4, dtype=torch.long)])
    assert sorted(closed) == ["deeper", "src"]


def test_hidden_state_error_per_layer_points_at_a_damaged_layer(pair, tmp_path):
    clean = json.loads(_run(pair, "--json", "-", "--min-top1", "0").output)["layers"]
    assert [row["layer"] for row in clean] == [0, 1] and all(0 < row["relative_error"] < 0.2 for row in clean)
    same = runner.invoke(app, ["evaluate", str(pair / "src"), str(pair / "src"), "--data",
                               str(pair / "ids.safetensors"), "--json", "-"])
    assert all(row["relative_error"] == 0 for row in json.loads(same.output)["layers"])

    damaged = tmp_path / "damaged"
    shutil.copytree(pair / "dst", damaged)
    name = "model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"
    shard = damaged / "model.safetensors"  # one shard at this size
    tensors = load_file(shard)
    tensors[name] = tensors[name] * 4
    save_file(tensors, shard, metadata={"format": "pt"})
    result = runner.invoke(app, ["evaluate", str(pair / "src"), str(damaged), "--data",
                                 str(pair / "ids.safetensors"), "--json", "-", "--min-top1", "0", "--max-kl", "1"])
    assert result.exit_code == 0, result.output
    layers = json.loads(result.output)["layers"]
    assert layers[0]["relative_error"] == pytest.approx(clean[0]["relative_error"])
    assert layers[1]["relative_error"] > 2 * clean[1]["relative_error"]


def test_card_gets_the_tables_and_verify_still_passes(pair, tmp_path):
    dst = tmp_path / "dst"
    assert runner.invoke(app, ["quantize", str(pair / "src"), str(dst), "--no-progress"]).exit_code == 0
    result = runner.invoke(app, ["evaluate", str(pair / "src"), str(dst), "--data", str(pair / "ids.safetensors"),
                                 "--min-top1", "0", "--card"])
    assert result.exit_code == 0, result.output
    assert "Hidden-state error" in result.output
    card = (dst / "README.md").read_text()
    report = json.loads((dst / "evaluation.json").read_text())
    assert "## Evaluation" in card and f"| perplexity ratio | {report['perplexity_ratio']:.3g} |" in card
    assert f"| 1 | {report['layers'][1]['relative_error']:.3g} |" in card
    verified = runner.invoke(app, ["verify", str(dst)])
    assert verified.exit_code == 0, verified.output


def test_card_needs_a_folder_quantize_wrote(pair):
    result = runner.invoke(app, ["evaluate", str(pair / "src"), str(pair / "src"), "--data",
                                 str(pair / "ids.safetensors"), "--card"])
    assert result.exit_code == 1 and "--card needs a DST written by" in result.output
    assert not (pair / "src" / "evaluation.json").exists()
