"""Shards larger than the machine's memory are read by range, never mapped whole (issue 19).

safetensors' torch `safe_open` maps a shard copy-on-write, which the kernel refuses for a file larger
than memory ("unable to mmap"); these shards are sparse files (truncate), so they cost no disk.
"""

import json
import os
import struct

import pytest
import torch

from quantize_moe.errors import UserError
from quantize_moe.source.checkpoint import Checkpoint

SMALL = torch.arange(8, dtype=torch.bfloat16)


def _sparse_checkpoint(folder, huge_bytes: int):
    """A folder whose one shard holds `small` (real bytes) and then `huge`, declared `huge_bytes` long
    and left as a hole. The header is written by hand: no writer makes a tensor without its data."""
    folder.mkdir()
    small_bytes = SMALL.numel() * 2
    header = {"small": {"dtype": "BF16", "shape": [SMALL.numel()], "data_offsets": [0, small_bytes]},
              "huge": {"dtype": "BF16", "shape": [huge_bytes // 2],
                       "data_offsets": [small_bytes, small_bytes + huge_bytes]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + SMALL.view(torch.uint8).numpy().tobytes())
    try:
        os.truncate(path, 8 + len(text) + small_bytes + huge_bytes)
    except OSError as e:  # a filesystem without sparse files this large
        pytest.skip(f"cannot make a sparse {huge_bytes >> 30} GiB file here: {e}")
    (folder / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    return folder


@pytest.mark.parametrize("huge_bytes", [40 << 30, 2 << 40], ids=["40GB", "2TB"])
def test_a_shard_larger_than_memory_opens_and_its_small_tensors_read(tmp_path, huge_bytes):
    checkpoint = Checkpoint(_sparse_checkpoint(tmp_path / "src", huge_bytes))
    assert checkpoint.tensors["huge"].nbytes == huge_bytes
    assert torch.equal(checkpoint.get("small"), SMALL)


def test_a_tensor_larger_than_memory_is_one_sentence(tmp_path):
    checkpoint = Checkpoint(_sparse_checkpoint(tmp_path / "src", 2 << 40))
    with pytest.raises(UserError, match=r"Tensor 'huge' in '.*model.safetensors' is 2199.0 GB, more than this "
                                        r"machine can hold in memory"):
        checkpoint.get("huge")
