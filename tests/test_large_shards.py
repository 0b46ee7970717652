"""Shards larger than the machine's memory are read by range, never mapped whole (issue 19).

safetensors' torch `safe_open` maps a shard copy-on-write, which the kernel refuses for a file larger
than memory ("unable to mmap", a traceback before this); these shards are sparse files (truncate), so
they cost no disk.
"""

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from quantize_moe.errors import UserError
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.tiny import build_tiny_checkpoint
from robust_checks import assert_refused, run_cli

SMALL = torch.arange(8, dtype=torch.bfloat16)
TWO_TB = 2 << 40


def _add_sparse_tensor(path, name: str, nbytes: int) -> None:
    """Declare one more bf16 tensor of `nbytes` at the end of safetensors file `path`, left as a hole.
    The header is edited by hand: no writer makes a tensor without writing its data."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8:8 + length]), data[8 + length:]
    header[name] = {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [len(body), len(body) + nbytes]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    try:
        os.truncate(path, 8 + len(text) + len(body) + nbytes)
    except OSError as e:  # a file system without sparse files this large
        pytest.skip(f"cannot make a sparse {nbytes >> 30} GiB file here: {e}")


def _sparse_checkpoint(folder, huge_bytes: int):
    """One shard holding `small` (real bytes) and `huge`, declared `huge_bytes` long."""
    folder.mkdir()
    save_file({"small": SMALL}, folder / "model.safetensors")
    _add_sparse_tensor(folder / "model.safetensors", "huge", huge_bytes)
    (folder / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    return folder


@pytest.mark.parametrize("huge_bytes", [40 << 30, TWO_TB], ids=["40GB", "2TB"])
def test_a_shard_larger_than_memory_opens_and_its_small_tensors_read(tmp_path, huge_bytes):
    checkpoint = Checkpoint(_sparse_checkpoint(tmp_path / "src", huge_bytes))
    assert checkpoint.tensors["huge"].nbytes == huge_bytes
    assert torch.equal(checkpoint.get("small"), SMALL)


def test_a_tensor_larger_than_memory_is_one_sentence(tmp_path):
    checkpoint = Checkpoint(_sparse_checkpoint(tmp_path / "src", TWO_TB))
    with pytest.raises(UserError, match=r"Tensor 'huge' in '.*model.safetensors' is 2199.0 GB, more than this "
                                        r"machine can hold in memory"):
        checkpoint.get("huge")


def test_quantize_of_a_model_with_a_2tb_shard_is_planned_and_refused_in_one_sentence(tmp_path):
    src = build_tiny_checkpoint("mixtral", tmp_path / "src", max_shard_size="1GB")
    _add_sparse_tensor(src / "model.safetensors", "model.extra_table.weight", TWO_TB)
    if shutil.disk_usage(tmp_path).free > TWO_TB:
        pytest.skip("this file system has room for 2 TB, so the run would not be refused")
    assert_refused(run_cli("quantize", src, tmp_path / "dst", "--no-progress"), "needs 2.20 TB")
    assert not (tmp_path / "dst").exists() or not any((tmp_path / "dst").iterdir())
