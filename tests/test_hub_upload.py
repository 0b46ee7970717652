"""Upload and model card, against a local HTTP endpoint that records what huggingface_hub sends."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from huggingface_hub import ModelCard, constants

from typer.testing import CliRunner

from fake_hub import FakeHub
from quantize_moe import __version__
from quantize_moe.cli.app import app
from quantize_moe.publish.model_card import VALIDATION_REPORT, build_card
from quantize_moe.plan.options import Options
from quantize_moe.write.job import quantize_checkpoint
from quantize_moe.source.tiny import build_tiny_checkpoint

TOKEN = "hf_quantizeMoeTestTokenThatMustNeverBePrinted"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("upload")
    build_tiny_checkpoint("mixtral", root / "src")
    (root / "src" / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: en\npipeline_tag: text-generation\n"
                                            "---\n# base\n")
    result = CliRunner().invoke(app, ["quantize", str(root / "src"), str(root / "dst"), "--max-shard-size", "200KB",
                                      "--no-progress"])
    assert result.exit_code == 0, result.output
    return root / "dst"


def cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantize_moe", *args], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_DISABLE_XET": "1", **env}, timeout=120)


def test_upload_creates_the_repo_uploads_shards_by_lfs_and_never_prints_the_token(quantized, tmp_path):
    with FakeHub(repo_id="org/tiny-moe-fp8") as hub:
        result = cli("upload", str(quantized), "org/tiny-moe-fp8", "--private",
                     env={"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert TOKEN not in result.stdout + result.stderr
    create = next(r for r in hub.requests if r.path == "/api/repos/create")
    assert json.loads(create.body)["visibility"] == "private"
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub.requests if r.method == "POST")

    operations = hub.commit_operations()
    committed = {op["value"]["path"]: op for op in operations if op["key"] in ("file", "lfsFile")}
    shards = sorted(p.name for p in quantized.glob("*.safetensors"))
    assert all(committed[s]["key"] == "lfsFile" for s in shards)
    # The fake refuses objects that do not hash to their oid and commits naming objects never uploaded,
    # so what it accepted is byte for byte what is on disk.
    assert all(hub.committed[s] == (quantized / s).read_bytes() for s in shards)
    assert hub.committed["config.json"] == (quantized / "config.json").read_bytes()
    assert {"README.md", "config.json", "model.safetensors.index.json"} <= set(committed)
    assert not any(p.startswith(".") or p.endswith(".partial") for p in committed)


def test_upload_without_a_token_is_one_sentence(quantized, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    result = CliRunner().invoke(app, ["upload", str(quantized), "org/x"], catch_exceptions=False)
    assert result.exit_code == 1
    assert "HF_TOKEN" in result.output


def test_model_card_front_matter_and_sections(quantized):
    card = build_card(quantized, "org/tiny-moe-fp8")
    data = card.data.to_dict()
    assert "base_model" not in data and "base_model_relation" not in data  # a local source names no base
    assert data["license"] == "apache-2.0" and data["language"] == "en"
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"fp8", "moe", "mixtral"} <= set(data["tags"])
    assert "vllm serve org/tiny-moe-fp8" in card.text
    assert "router: top-k choices flip" in card.text
    # the resolved choice of `auto`, so the command reproduces the output even if the rule changes
    assert ("quantize-moe quantize SRC dst --scheme channel --format compressed-tensors --max-shard-size 200000"
            in card.text)
    # not on PyPI: installed from its source; a local SRC is a placeholder, not this machine's path
    assert "pip install quantize-moe\n" not in card.text and f"pip install quantize_moe-{__version__}.tar.gz" in card.text
    assert "`SRC` is the original checkpoint" in card.text
    assert "## Validation" not in card.text
    assert ModelCard(str(card)).data.to_dict() == data  # the Hub parses what we write


def test_model_card_includes_the_validation_report(quantized):
    (quantized / VALIDATION_REPORT).write_text(json.dumps({"layers": [
        {"layer": 0, "relative_error": 0.012, "ok": True}, {"layer": 1, "relative_error": 0.013, "ok": True}]}))
    try:
        card = build_card(quantized, "org/tiny-moe-fp8")
    finally:
        (quantized / VALIDATION_REPORT).unlink()
    assert "## Validation" in card.text
    assert "| layer | relative_error | ok |" in card.text and "| 1 | 0.013 | True |" in card.text


def test_base_model_and_revision_come_from_a_hub_snapshot(tmp_path):
    snapshot = tmp_path / "hub" / "models--org--tiny-moe" / "snapshots" / "abc123"
    build_tiny_checkpoint("qwen3_moe", snapshot)
    quantize_checkpoint(snapshot, tmp_path / "dst", Options(), show_progress=False)
    from quantize_moe.source.checkpoint import Checkpoint
    from quantize_moe.publish.model_card import record_run
    record_run(tmp_path / "dst", Checkpoint(snapshot), str(snapshot), Options(experts_only=True))
    card = build_card(tmp_path / "dst")
    assert card.data.base_model == "org/tiny-moe" and card.data.base_model_relation == "quantized"
    assert "at `abc123`" in card.text
    assert "quantize-moe quantize org/tiny-moe dst --experts-only" in card.text


def test_fake_hub_refuses_bytes_that_are_not_their_oid_and_commits_of_objects_never_uploaded():
    """The upload test trusts the fake's strictness; this is where that strictness can fail."""
    data = b"shard bytes"
    oid = hashlib.sha256(data).hexdigest()
    op = json.dumps({"key": "lfsFile", "value": {"path": "model.safetensors", "algo": "sha256", "oid": oid,
                                                 "size": len(data)}}).encode()

    def send(hub, method, path, body):
        request = urllib.request.Request(hub.endpoint + path, data=body, method=method)
        try:
            return urllib.request.urlopen(request).status
        except urllib.error.HTTPError as e:
            return e.code

    with FakeHub(repo_id="org/x") as hub:
        commit = "/api/models/org/x/commit/main"
        assert send(hub, "POST", commit, op) == 422
        batch = json.dumps({"objects": [{"oid": oid, "size": len(data)}]}).encode()
        assert send(hub, "POST", "/org/x.git/info/lfs/objects/batch", batch) == 200
        assert send(hub, "PUT", f"/lfs-upload/{oid}", b"other bytes") == 400
        assert send(hub, "POST", commit, op) == 422
        assert send(hub, "PUT", f"/lfs-upload/{oid}", data) == 200
        assert send(hub, "POST", commit, op) == 200 and hub.committed == {"model.safetensors": data}
