"""Tensor bytes read by range from safetensors files: where each tensor lies, and `pread` into a
buffer the caller owns (every tensor `Checkpoint.get` returns, the engine's raw reads and the digests
of written shards). Nothing maps a whole shard: safetensors' torch `safe_open` maps the file
copy-on-write, which the kernel refuses for a shard larger than the machine's memory ("unable to
mmap", a 40 GB shard on a 24 GB machine), so headers are read through its numpy `safe_open`, which
maps read-only and touches only the header.

Where a tensor lies comes from `safe_open(...).offset_keys()` (tensors in data
order) and the format's rule that the data region holds them back to back with
no gaps and ends the file.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

HEADER_FRAMEWORK = "numpy"  # safe_open's read-only mapping: metadata of a shard of any size

# safetensors dtype strings as reported by get_slice().get_dtype()
SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def data_offsets(path: Path, sizes: dict[str, int]) -> dict[str, int]:
    """File offset of each tensor's first byte, in file order; `sizes` are the byte sizes of all
    tensors in the file."""
    with safe_open(path, framework=HEADER_FRAMEWORK) as f:
        return _offsets(path, f.offset_keys(), sizes)


def _offsets(path: Path, order: list[str], sizes: dict[str, int]) -> dict[str, int]:
    """The data region holds the tensors back to back and ends the file."""
    offset = os.path.getsize(path) - sum(sizes[name] for name in order)
    offsets = {}
    for name in order:
        offsets[name] = offset
        offset += sizes[name]
    return offsets


def tensor_regions(path: Path) -> dict[str, tuple[int, int]] | None:
    """(offset, byte size) of every tensor of a safetensors file in file order, or None when safetensors
    cannot read the file or it holds a dtype torch lacks."""
    try:
        with safe_open(path, framework=HEADER_FRAMEWORK) as f:
            order = f.offset_keys()
            slices = {name: f.get_slice(name) for name in order}
            sizes = {name: SAFETENSORS_DTYPES[s.get_dtype()].itemsize * math.prod(s.get_shape())
                     for name, s in slices.items()}
    except (SafetensorError, KeyError):
        return None
    return {name: (offset, sizes[name]) for name, offset in _offsets(path, order, sizes).items()}


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy (the caller keeps `tensor` alive)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


STAGING_BYTES = 32 << 20  # pinned host memory per reading thread, for tensors read onto a GPU
_staging = threading.local()


def read_into(fd: int, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous tensor `out` with the bytes at `offset` of `fd`: straight into it on the CPU, on
    a GPU through a pinned buffer of this thread's (so no host copy of the tensor is made)."""
    if out.device.type == "cpu":
        return _pread_into(fd, offset, as_bytes(out))
    if getattr(_staging, "buffer", None) is None:
        _staging.buffer = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
    flat = out.view(-1).view(torch.uint8)
    for start in range(0, flat.numel(), STAGING_BYTES):
        chunk = _staging.buffer[:min(STAGING_BYTES, flat.numel() - start)]
        _pread_into(fd, offset + start, as_bytes(chunk))
        flat[start:start + chunk.numel()].copy_(chunk)  # synchronous: the buffer is reused next


def _pread_into(fd: int, offset: int, view: memoryview) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise EOFError(f"file ended {len(view)} bytes early at offset {offset}")
        view, offset = view[n:], offset + n
