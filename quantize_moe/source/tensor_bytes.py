"""Tensor bytes read by range from safetensors files: `pread` into a buffer the caller owns (every
tensor `Checkpoint.get` returns and the engine's raw reads), at the offsets `locations` finds in the
header. Nothing maps a whole shard ("unable to mmap": a 40 GB shard on a 24 GB machine)."""

from __future__ import annotations

import ctypes
import os
import threading

import torch

# safetensors dtype strings as reported by get_slice().get_dtype()
SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


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
