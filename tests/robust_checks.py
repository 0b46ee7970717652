"""What every refused or interrupted run must leave true, checked from the outside.

A source checkpoint is built once per session and copied per test; `snapshot`
hashes a folder tree so a test can prove SRC is unchanged byte for byte and that
nothing outside DST was written.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantize_moe.cli.app import app

SHARD_SIZE = "100KB"  # the tiny Mixtral is ~280 KB in bf16: 5 source shards, 3 FP8 output shards


@pytest.fixture(scope="session")
def mixtral_src(tiny_checkpoint) -> Path:
    """The session's tiny Mixtral in 5 shards; its own cache entry (explicit shard size), never written."""
    return tiny_checkpoint("mixtral", max_shard_size=SHARD_SIZE)


@pytest.fixture
def src(mixtral_src, tmp_path) -> Path:
    """A private, writable copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(mixtral_src, tmp_path / "src"))


def snapshot(root: Path, skip: Path | None = None) -> dict[str, str]:
    """relative path -> sha256 of the bytes (or the target of a link) of everything under root but skip."""
    tree = {}
    for path in sorted(root.rglob("*")):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        key = path.relative_to(root).as_posix()
        if path.is_symlink():
            tree[key] = "-> " + os.readlink(path)
        elif path.is_file():
            tree[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            tree[key] = "folder"
    return tree


def run_cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def assert_refused(result, *fragments: str, code: int = 1) -> str:
    """Exit code 1 (2 for a bad command line) and only one error sentence on the terminal, containing
    every fragment."""
    text = " ".join(result.output.split())
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert text.startswith("error: ") and text.endswith("."), text
    assert text.count("error:") == 1, text
    for fragment in fragments:
        assert fragment in text, text
    return text
