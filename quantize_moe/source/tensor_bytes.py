"""Tensor bytes read in place from safetensors files: where each tensor lies, and one `pread` into a
buffer the caller reuses (the engine's raw reads and the digests of written shards).

Where a tensor lies comes from `safe_open(...).offset_keys()` (tensors in data
order) and the format's rule that the data region holds them back to back with
no gaps and ends the file.
"""

from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from quantize_moe.source.checkpoint import SAFETENSORS_DTYPES


def data_offsets(path: Path, sizes: dict[str, int]) -> dict[str, int]:
    """File offset of each tensor's first byte, in file order; `sizes` are the byte sizes of all
    tensors in the file."""
    with safe_open(path, framework="pt") as f:
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
        with safe_open(path, framework="pt") as f:
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


def read_into(fd: int, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes at `offset` of `fd`."""
    view = as_bytes(out)
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise EOFError(f"file ended {len(view)} bytes early at offset {offset}")
        view, offset = view[n:], offset + n
