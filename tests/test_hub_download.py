"""Hub repo ids as SRC: from a pre-populated huggingface_hub cache with HF_HUB_OFFLINE=1, and streamed
shard by shard from a local HTTP endpoint."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from fake_hub import COMMIT, FakeHub
from quantize_moe.errors import UserError
from quantize_moe.source.hub import HubSource, StreamedCheckpoint, open_source, parse_source
from quantize_moe.source.tiny import build_tiny_checkpoint

REPO = "org/tiny-moe"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    folder = build_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("hub") / "src", max_shard_size="60KB")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")
    (folder / "pytorch_model.bin").write_bytes(b"pickle weights that must never be downloaded")
    return folder


def populate_cache(hf_home: Path, files: Path, *, skip: tuple[str, ...] = ()) -> Path:
    """The layout huggingface_hub's cache documents: blobs by hash, a snapshot of links, a ref to the commit."""
    repo = hf_home / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for file in files.iterdir():
        if file.name in skip:
            continue
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantize_moe", *args], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "", **env}, timeout=180)


def test_parse_source():
    assert parse_source("org/name") == HubSource("org/name")
    assert parse_source("org/name@v1.0") == HubSource("org/name", "v1.0")
    assert parse_source("./org/name") == Path("./org/name")
    assert parse_source("/abs/folder") == Path("/abs/folder")


def test_quantize_from_the_cache_offline(source, tmp_path):
    populate_cache(tmp_path / "hf", source)
    result = cli("quantize", REPO, str(tmp_path / "dst"), "--no-progress",
                 env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "dst" / "quantize_moe_run.json").read_text())
    assert (record["base_model"], record["base_revision"]) == (REPO, COMMIT)
    assert "base_model: org/tiny-moe" in (tmp_path / "dst" / "README.md").read_text()
    assert "license: mit" in (tmp_path / "dst" / "README.md").read_text()
    verify = cli("verify", str(tmp_path / "dst"), "--against", REPO, "--json",
                 env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"]


def test_offline_without_the_repo_in_the_cache_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UserError, match="HF_HUB_OFFLINE"):
        open_source("org/absent")


def test_offline_with_a_shard_missing_from_the_cache(source, tmp_path, monkeypatch):
    missing = sorted(p.name for p in source.glob("*.safetensors"))[1]
    populate_cache(tmp_path / "hf", source, skip=(missing,))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(UserError, match=missing):
        open_source(REPO)


def test_stream_downloads_and_frees_shards_one_by_one(source, tmp_path):
    """--stream against a local endpoint: headers by range requests, each shard fetched once and deleted."""
    shards = sorted(p.name for p in source.glob("*.safetensors"))
    assert len(shards) >= 4
    with FakeHub(repo_id=REPO, served=source) as hub:
        result = cli("quantize", REPO, str(tmp_path / "dst"), "--stream", "--no-progress",
                     env={"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.endpoint})
    assert result.returncode == 0, result.stderr
    fetched = [r.path.rsplit("/", 1)[-1] for r in hub.requests
               if r.method == "GET" and "/resolve/" in r.path and "range" not in r.headers]
    assert sorted(f for f in fetched if f.endswith(".safetensors")) == shards  # each shard downloaded once
    assert "pytorch_model.bin" not in fetched
    assert any("range" in r.headers for r in hub.requests)  # headers read without downloading shards
    cached = tmp_path / "hf" / "hub" / f"models--{REPO.replace('/', '--')}"
    assert not list(cached.rglob("*.safetensors"))  # shards never land in the cache
    assert not (tmp_path / "dst" / ".quantize-moe-download").exists()
    verify = cli("verify", str(tmp_path / "dst"), "--against", str(source), env={})
    assert verify.returncode == 0, verify.stdout


@pytest.mark.parametrize("layers", [2, 14])
def test_streamed_checkpoint_frees_each_shard_after_its_last_tensor(source, tmp_path, layers):
    """A shard is deleted as soon as its last tensor is read, and the plan reads shards in their order, so
    the disk holds a few shards at a time however large the model (here shards are smaller than a layer,
    the worst case: 9 and 57 shards, at most 4 on disk; 14 layers also put layer 10 before layer 2 in the
    index's alphabetical order)."""
    if layers != 2:
        source = build_tiny_checkpoint("mixtral", tmp_path / "src", max_shard_size="60KB", num_hidden_layers=layers)
    with FakeHub(repo_id=REPO, served=source) as hub:
        code = ("from pathlib import Path\nfrom quantize_moe.source.hub import open_source\n"
                "from quantize_moe.plan.plan import make_plan\n"
                f"c = open_source('{REPO}', stream=True, scratch=Path('{tmp_path / 'scratch'}'))\n"
                "for item in make_plan(c).items:\n    [c.get(n) for n in item.sources]\n"
                "print(c.peak_shards_on_disk, len(c.shard_files))")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                                env={**os.environ, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf"),
                                     "HF_ENDPOINT": hub.endpoint})
    assert result.returncode == 0, result.stderr
    peak, total = map(int, result.stdout.split())
    assert peak <= 4 and total >= 9
    assert not list((tmp_path / "scratch").rglob("*.safetensors"))
