"""A run killed with SIGKILL at any point, then resumed, ends byte-identical to an
uninterrupted run; the manifest catches output files altered or truncated later."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quantize_moe.source.locations import CONFIG_NAME
from quantize_moe.write.digests import file_digest
from quantize_moe.write.manifest import MANIFEST_NAME, Manifest
from robust_checks import SHARD_SIZE, assert_refused, mixtral_src, run_cli, snapshot  # noqa: F401

ARGS = ("--max-shard-size", SHARD_SIZE, "--no-progress")

# Runs the CLI in a child that SIGKILLs itself around the n-th os.replace, i.e. the n-th file put in
# place. Workers put shards in place while another worker may be writing the manifest, so the order
# varies from run to run; for the tiny Mixtral it is about 1 manifest, 2 shard 1, 3 manifest,
# 4 shard 2, 5 manifest, 6 shard 3, 7 manifest, 8 generation_config.json, 9 index, 10 config.json,
# 11 final manifest (the last four always come last, in that order).
# "before": the temporary file is complete but not renamed; "after": renamed, nothing after it done;
# "torn": the temporary file is cut to half its size first, as if killed while writing it.
# The count is taken under a lock: two threads renaming at once must not both miss (or both take) n.
KILLER = """
import os, signal, sys, threading
n, when = int(sys.argv[1]), sys.argv[2]
rename, calls, counting = os.replace, 0, threading.Lock()
def replace(tmp, final):
    global calls
    with counting:
        calls += 1
        mine = calls
    if mine == n and when == "torn":
        os.truncate(tmp, os.path.getsize(tmp) // 2)
    if mine == n and when in ("before", "torn"):
        os.kill(os.getpid(), signal.SIGKILL)
    rename(tmp, final)
    if mine == n and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
from quantize_moe.cli.app import app
app(sys.argv[3:])
"""


@pytest.fixture(scope="session")
def reference(mixtral_src, tmp_path_factory) -> dict[str, str]:  # noqa: F811
    """The bytes of every file of an uninterrupted run."""
    dst = tmp_path_factory.mktemp("reference") / "dst"
    assert run_cli("quantize", mixtral_src, dst, *ARGS).exit_code == 0
    return snapshot(dst)


def killed_run(src: Path, dst: Path, n: int, when: str) -> None:
    child = subprocess.run([sys.executable, "-c", KILLER, str(n), when, "quantize", str(src), str(dst), *ARGS],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -9, child.stderr


@pytest.mark.parametrize("n, when", [(1, "before"), (2, "torn"), (4, "after"), (5, "torn"), (10, "after")])
def test_resume_after_kill_is_byte_identical(mixtral_src, reference, tmp_path, n, when):  # noqa: F811
    dst = tmp_path / "dst"
    before = snapshot(mixtral_src)
    killed_run(mixtral_src, dst, n, when)
    if n < 10:  # config.json is the 10th file
        assert not (dst / CONFIG_NAME).exists(), "an interrupted run must not look complete"
    assert_refused(run_cli("quantize", mixtral_src, dst, *ARGS), "--resume")
    result = run_cli("quantize", mixtral_src, dst, "--resume", *ARGS)
    assert result.exit_code == 0, result.output
    assert snapshot(dst) == reference
    assert snapshot(mixtral_src) == before


@pytest.fixture
def finished(mixtral_src, tmp_path) -> Path:  # noqa: F811
    dst = tmp_path / "dst"
    assert run_cli("quantize", mixtral_src, dst, *ARGS).exit_code == 0
    return dst


def test_resume_keeps_finished_shards_and_rewrites_altered_ones(mixtral_src, reference, finished):  # noqa: F811
    intact, altered = finished / "model-00001-of-00003.safetensors", finished / "model-00002-of-00003.safetensors"
    data = bytearray(altered.read_bytes())
    data[-1] ^= 0xFF
    altered.write_bytes(bytes(data))
    intact_mtime = intact.stat().st_mtime_ns
    assert run_cli("quantize", mixtral_src, finished, "--resume", *ARGS).exit_code == 0
    assert snapshot(finished) == reference
    assert intact.stat().st_mtime_ns == intact_mtime


def test_manifest_detects_truncated_and_altered_files(finished):
    manifest = Manifest.load(finished)
    assert manifest.complete and manifest.matching(manifest.files) == set(manifest.files)
    shard = finished / "model-00003-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size - 1)
    (finished / CONFIG_NAME).write_text((finished / CONFIG_NAME).read_text().replace("mixtral", "mixtrak"))
    assert sorted(set(manifest.files) - manifest.matching(manifest.files)) == [CONFIG_NAME, shard.name]


@pytest.mark.parametrize("where", [0, 20, -1])  # header length, header JSON, last tensor's last byte
def test_shard_digest_changes_with_any_byte(finished, where):
    shard = finished / "model-00001-of-00003.safetensors"
    recorded = Manifest.load(finished).files[shard.name].digest
    assert file_digest(shard) == recorded
    data = bytearray(shard.read_bytes())
    data[where] ^= 1
    shard.write_bytes(data)
    assert file_digest(shard) != recorded


def test_resume_with_other_options_is_refused(mixtral_src, finished):  # noqa: F811
    before = snapshot(finished)
    assert_refused(run_cli("quantize", mixtral_src, finished, "--resume", "--experts-only", *ARGS),
                   MANIFEST_NAME, "different SRC, options")
    assert snapshot(finished) == before


def test_damaged_manifest_is_refused(mixtral_src, finished):  # noqa: F811
    (finished / MANIFEST_NAME).write_text("{")
    assert_refused(run_cli("quantize", mixtral_src, finished, "--resume", *ARGS), "is damaged", "--overwrite")


def test_overwrite_replaces_an_earlier_run(mixtral_src, reference, finished):  # noqa: F811
    (finished / "model-00002-of-00003.safetensors").write_bytes(b"stale")
    assert run_cli("quantize", mixtral_src, finished, "--overwrite", *ARGS).exit_code == 0
    assert snapshot(finished) == reference


def rewrite_same_size(shard: Path, keep_mtime: bool) -> None:
    """New bytes in every tensor of `shard`, same names, dtypes, shapes and file size (another save)."""
    from safetensors.torch import load_file, save_file

    stat = shard.stat()
    save_file({name: t.flip(-1) for name, t in load_file(shard).items()}, shard, metadata={"format": "pt"})
    assert shard.stat().st_size == stat.st_size
    if keep_mtime:  # as `cp -p` or a restore from a backup would leave it
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["new mtime", "mtime kept"])
def test_resume_after_the_source_bytes_changed_is_refused(mixtral_src, tmp_path, keep_mtime):  # noqa: F811
    src = Path(shutil.copytree(mixtral_src, tmp_path / "src", copy_function=shutil.copy2))
    dst = tmp_path / "dst"
    killed_run(src, dst, 4, "after")  # the first output shard is finished
    rewrite_same_size(sorted(src.glob("*.safetensors"))[-1], keep_mtime)
    before = snapshot(dst)
    assert_refused(run_cli("quantize", src, dst, "--resume", *ARGS), "changed since", "--overwrite")
    assert snapshot(dst) == before


def test_resume_of_an_untouched_copy_matches_the_original_run(mixtral_src, reference, tmp_path):  # noqa: F811
    """The source record holds only what SRC's shards are: a copy keeping their times resumes, and its
    checkpoint ends byte-identical to the uninterrupted run of the original (the run record and card
    name the source folder, which differs)."""
    src = Path(shutil.copytree(mixtral_src, tmp_path / "src", copy_function=shutil.copy2))
    dst = tmp_path / "dst"
    killed_run(src, dst, 4, "after")
    assert run_cli("quantize", src, dst, "--resume", *ARGS).exit_code == 0
    weights = {k: v for k, v in reference.items() if k.endswith((".safetensors", ".json")) and "quantize" not in k}
    assert {k: snapshot(dst)[k] for k in weights} == weights
