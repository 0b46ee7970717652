"""Tensor bytes read and written in place inside safetensors files.

The engine never holds a whole shard. It reads each source tensor with one
`pread` into a buffer it reuses, and writes an output shard in two steps:
safetensors' own serializer lays the file out (header and every tensor's
place), filled from a read-only zero mapping, which costs no resident memory;
then each tensor's bytes are written into its place as soon as they exist.
The zero fill costs one memory copy of the shard into the page cache, far less
than holding the shard, and it keeps the header safetensors' business.

Where a tensor lies comes from `safe_open(...).offset_keys()` (tensors in data
order) and the format's rule that the data region holds them back to back with
no gaps and ends the file.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors import TensorSpec, safe_open, serialize_file

from quantize_moe.output import PARTIAL_SUFFIX
from quantize_moe.plan import OutputTensor

COPY_BUFFER_BYTES = 64 << 20  # a multiple of every dtype's size


def data_offsets(path: Path, sizes: dict[str, int]) -> dict[str, int]:
    """File offset of each tensor's first byte; `sizes` are the byte sizes of all tensors in the file."""
    with safe_open(path, framework="pt") as f:
        order = f.offset_keys()
    offset = os.path.getsize(path) - sum(sizes[name] for name in order)
    offsets = {}
    for name in order:
        offsets[name] = offset
        offset += sizes[name]
    return offsets


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy (the caller keeps `tensor` alive)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def read_into(fd: int, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes at `offset` of `fd`."""
    view = _as_bytes(out)
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise EOFError(f"file ended {len(view)} bytes early at offset {offset}")
        view, offset = view[n:], offset + n


def write_at(fd: int, offset: int, tensor: torch.Tensor) -> None:
    view = _as_bytes(tensor)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int,
               check: Callable[[torch.Tensor], None] | None = None) -> None:
    """Copy bytes file to file inside the kernel, so they never enter this process's memory. When the
    bytes must be looked at (`check` sees each chunk), or across file systems that refuse
    `copy_file_range`, through a bounded buffer."""
    if check is None:
        try:
            while count:
                n = os.copy_file_range(src_fd, dst_fd, count, src_offset, dst_offset)
                if n == 0:
                    raise EOFError(f"source ended {count} bytes early at offset {src_offset}")
                src_offset, dst_offset, count = src_offset + n, dst_offset + n, count - n
            return
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
    buffer = torch.empty(min(count, COPY_BUFFER_BYTES), dtype=torch.uint8)
    while count:
        chunk = buffer[:min(count, len(buffer))]
        read_into(src_fd, src_offset, chunk)
        if check is not None:
            check(chunk)
        write_at(dst_fd, dst_offset, chunk)
        src_offset, dst_offset, count = src_offset + len(chunk), dst_offset + len(chunk), count - len(chunk)


class ShardFile:
    """One output shard under its temporary name: laid out at creation, filled tensor by tensor,
    renamed to its final name by `finish` once every tensor is written."""

    def __init__(self, path: Path, tensors: list[OutputTensor]):
        self.path = path
        self.partial = path.with_name(path.name + PARTIAL_SUFFIX)
        sizes = {t.name: t.nbytes for t in tensors}
        # Private anonymous pages that are only read all map the kernel's one zero page: no resident memory.
        zeros = mmap.mmap(-1, max([1, *sizes.values()]), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        first_byte = ctypes.c_char.from_buffer(zeros)
        address = ctypes.addressof(first_byte)
        specs = {t.name: TensorSpec(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                                    data_ptr=address, data_len=t.nbytes) for t in tensors}
        serialize_file(specs, self.partial, {"format": "pt"})
        del first_byte  # the mapping cannot close while a ctypes object points into it
        zeros.close()
        self.offsets = data_offsets(self.partial, sizes)
        self.fd = os.open(self.partial, os.O_WRONLY)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        write_at(self.fd, self.offsets[name], tensor)

    def copy_from(self, name: str, src_fd: int, src_offset: int, count: int,
                  check: Callable[[torch.Tensor], None] | None = None) -> None:
        copy_range(src_fd, src_offset, self.fd, self.offsets[name], count, check)

    def finish(self) -> None:
        os.close(self.fd)
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        os.close(self.fd)
        self.partial.unlink(missing_ok=True)

