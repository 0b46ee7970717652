"""Tensor bytes read and written in place inside safetensors files.

The engine never holds a whole shard. It reads each source tensor with one
`pread` into a buffer it reuses, and writes an output shard in two steps: the
shard is laid out (safetensors' own header, then a data region of the right
size that is allocated but never written), then each tensor's bytes are written
into their place as soon as they exist, and written behind (`written_behind`):
put on disk and dropped from the page cache at once. Only the real bytes are
ever written, once; allocating the region up front (`fallocate`) makes those
writes about twice as fast as filling a hole, and a full disk fails before any
work.

safetensors' serializer only writes whole files, so the header is assembled
here from what the serializer says about one-element stand-ins
(`safetensors_header`).

Where a tensor lies comes from `safe_open(...).offset_keys()` (tensors in data
order) and the format's rule that the data region holds them back to back with
no gaps and ends the file.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from quantize_moe.checkpoint import SAFETENSORS_DTYPES
from quantize_moe.output import PARTIAL_SUFFIX
from quantize_moe.plan import OutputTensor

COPY_BUFFER_BYTES = 64 << 20  # a multiple of every dtype's size
HEADER_LENGTH_BYTES = 8  # the little-endian u64 that starts every safetensors file
HEADER_ALIGNMENT = 8  # safetensors pads its JSON header with spaces to a multiple of this


def safetensors_header(tensors: list[OutputTensor], metadata: dict[str, str]) -> bytes:
    """The bytes a safetensors file of these tensors starts with (length and JSON header), byte for byte
    as safetensors' serializer writes them, without the data that follows.

    safetensors has no call that lays a file out without writing its data, so the serializer is asked
    for what depends on its rules (the data order and the dtype names) with one-element stand-ins, and the
    shapes and offsets are filled in here; tests check the result against the serializer's own output.
    """
    layout = _read_header(save({t.name: torch.zeros(1, dtype=t.dtype) for t in tensors}, metadata))
    header = {"__metadata__": layout.pop("__metadata__")} if "__metadata__" in layout else {}
    offset, by_name = 0, {t.name: t for t in tensors}
    for name, entry in sorted(layout.items(), key=lambda item: item[1]["data_offsets"]):
        tensor = by_name[name]
        header[name] = {"dtype": entry["dtype"], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % HEADER_ALIGNMENT)
    return len(text).to_bytes(HEADER_LENGTH_BYTES, "little") + text


def _read_header(serialized: bytes) -> dict:
    length = int.from_bytes(serialized[:HEADER_LENGTH_BYTES], "little")
    return json.loads(serialized[HEADER_LENGTH_BYTES:HEADER_LENGTH_BYTES + length])


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4  # <linux/fs.h> SYNC_FILE_RANGE_*
WRITE_BEHIND_MIN_BYTES = 1 << 20  # smaller writes (scales) are left to the kernel


def allocate(fd: int, size: int, path: Path) -> None:
    """Make the file `size` bytes long with its blocks allocated (reading as zeros) where the file
    system can (`fallocate`), else as a hole (`ftruncate`): never by writing zeros."""
    if _libc.fallocate(fd, 0, 0, size) == 0:
        return
    error = ctypes.get_errno()
    if error not in (errno.EOPNOTSUPP, errno.ENOSYS):
        raise OSError(error, os.strerror(error), str(path))
    os.ftruncate(fd, size)


@contextmanager
def written_behind(fd: int, offset: int, count: int):
    """Around work that needs no disk (hashing what was written): start putting `count` written bytes
    at `offset` on disk, run the work while the disk writes, then wait for them and drop them from
    the page cache.

    An output left to pile up in the page cache evicts the source there and on a machine smaller
    than the model ends up written back in bursts that stall every writer; on a VM whose free
    memory goes back to the host, growing the page cache is itself slow (here: 3.4 GB of buffered
    writes ran at 0.4-0.6 GB/s, 2.0-2.5 GB/s written behind, the disk takes 3.3 GB/s). The
    pages written behind are reused for the next writes instead. Where the file system cannot
    do this, the bytes stay in the page cache as with any write."""
    started = count >= WRITE_BEHIND_MIN_BYTES and _libc.sync_file_range(fd, offset, count, _SYNC_WRITE) == 0
    yield
    if started and _libc.sync_file_range(fd, offset, count, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER) == 0:
        os.posix_fadvise(fd, offset, count, os.POSIX_FADV_DONTNEED)


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
    write_all_at(fd, offset, _as_bytes(tensor))


def write_all_at(fd: int, offset: int, view: memoryview | bytes) -> None:
    view = memoryview(view)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int,
               check: Callable[[torch.Tensor], None] | None = None) -> bytes:
    """Copy bytes file to file through a bounded buffer; `check` sees each chunk on the way. Returns
    the sha256 of the bytes."""
    digest = hashlib.sha256()
    buffer = torch.empty(min(count, COPY_BUFFER_BYTES), dtype=torch.uint8)
    while count:
        chunk = buffer[:min(count, len(buffer))]
        read_into(src_fd, src_offset, chunk)
        if check is not None:
            check(chunk)
        write_at(dst_fd, dst_offset, chunk)
        with written_behind(dst_fd, dst_offset, len(chunk)):
            digest.update(_as_bytes(chunk))
        src_offset, dst_offset, count = src_offset + len(chunk), dst_offset + len(chunk), count - len(chunk)
    return digest.digest()


class ShardFile:
    """One output shard under its temporary name: laid out at creation, filled tensor by tensor,
    renamed to its final name by `finish` once every tensor is written. It keeps the sha256 of its
    header and of every tensor written, for the shard's digest (`quantize_moe.digests`)."""

    def __init__(self, path: Path, tensors: list[OutputTensor]):
        self.path = path
        self.partial = path.with_name(path.name + PARTIAL_SUFFIX)
        header = safetensors_header(tensors, {"format": "pt"})
        self.header_sha256 = hashlib.sha256(header).digest()
        self.tensor_sha256: dict[str, bytes] = {}
        self.fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        write_all_at(self.fd, 0, header)
        allocate(self.fd, len(header) + sum(t.nbytes for t in tensors), self.partial)
        self.offsets = data_offsets(self.partial, {t.name: t.nbytes for t in tensors})

    def write(self, name: str, tensor: torch.Tensor) -> None:
        view = _as_bytes(tensor)
        write_all_at(self.fd, self.offsets[name], view)
        with written_behind(self.fd, self.offsets[name], len(view)):
            self.tensor_sha256[name] = hashlib.sha256(view).digest()

    def copy_from(self, name: str, src_fd: int, src_offset: int, count: int,
                  check: Callable[[torch.Tensor], None] | None = None) -> None:
        self.tensor_sha256[name] = copy_range(src_fd, src_offset, self.fd, self.offsets[name], count, check)

    def tensor_sha256s(self) -> list[bytes]:
        """The sha256 of every tensor, in file order (all of them must have been written)."""
        return [self.tensor_sha256[name] for name in self.offsets]

    def finish(self) -> None:
        os.close(self.fd)
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        os.close(self.fd)
        self.partial.unlink(missing_ok=True)
