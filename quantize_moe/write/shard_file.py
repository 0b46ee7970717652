"""Output shards laid out and filled in place: safetensors header first, then each tensor at its offset.

The engine never holds a whole shard. It reads each source tensor with one
`pread` into a buffer it reuses, and writes an output shard in two steps: the
shard is laid out (safetensors' own header, then a data region of the right
size that is allocated but never written), then each tensor's bytes are written
into their place as soon as they exist. Only the real bytes are ever written,
once; allocating the region up front (`fallocate`) makes those writes about
twice as fast as filling a hole, and a full disk fails before any work.

A large tensor goes to the disk without the page cache (`O_DIRECT`): its whole
pages straight from the caller's buffer, the few bytes before its first page
boundary and after its last through the page cache. That needs the bytes in
memory to line up with their place in the file (`placed`), which the engine
arranges for the buffers it quantizes into. Several workers writing direct keep
several requests in flight, which a virtual disk needs to reach its rate
(here, 4 GiB into one file: 3.4 GB/s from 3 threads written direct, 2.2 GB/s
through the page cache). Where the file system refuses `O_DIRECT` or the bytes
do not line up, a tensor is written through the page cache and written behind
(`written_behind`): put on disk and dropped from the page cache at once.

safetensors' serializer only writes whole files, so the header is assembled
here from what the serializer says about one-element stand-ins
(`safetensors_header`).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save

from quantize_moe.source.tensor_bytes import as_bytes, read_into
from quantize_moe.source.locations import data_offsets
from quantize_moe.write.destination import PARTIAL_SUFFIX
from quantize_moe.plan.plan import OutputTensor

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
DIRECT_MIN_BYTES = 1 << 20  # smaller tensors go through the page cache
DIRECT_ALIGNMENT = 4096  # O_DIRECT: offsets, lengths and addresses in whole pages (a page spans any block size)


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


def write_all_at(fd: int, offset: int, view: memoryview | bytes) -> None:
    view = memoryview(view)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def copy_scratch_bytes(nbytes: int) -> int:
    """The scratch bytes `ShardFile.copy_from` needs to copy a tensor of `nbytes`."""
    return min(nbytes, COPY_BUFFER_BYTES) + DIRECT_ALIGNMENT


def placed(buffer: torch.Tensor, start: int, nbytes: int, file_offset: int) -> torch.Tensor:
    """`nbytes` of the flat byte tensor `buffer`, from `start` or at most DIRECT_ALIGNMENT - 1 bytes
    past it, lined up with a file offset: their address and `file_offset` are equal modulo
    DIRECT_ALIGNMENT, so the whole pages of a tensor written there can go to the disk direct."""
    begin = start + (file_offset - buffer.data_ptr() - start) % DIRECT_ALIGNMENT
    return buffer[begin:begin + nbytes]


def _open_direct(path: Path) -> int | None:
    """A second descriptor of `path` that writes around the page cache, or None where the file
    system does not offer that (tmpfs, say)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return None
        raise OSError(error.errno, error.strerror, str(path)) from None


class ShardFile:
    """One output shard under its temporary name: laid out at creation, filled tensor by tensor,
    renamed to its final name by `finish` once every tensor is written. It keeps the sha256 of its
    header and, unless `digests` is off (no manifest will list the shard), of every tensor written,
    for the shard's digest (`quantize_moe.write.digests`)."""

    def __init__(self, path: Path, tensors: list[OutputTensor], digests: bool = True):
        self.path, self.digests = path, digests
        self.partial = path.with_name(path.name + PARTIAL_SUFFIX)
        header = safetensors_header(tensors, {"format": "pt"})
        self.header_sha256 = hashlib.sha256(header).digest()
        self.tensor_sha256: dict[str, bytes] = {}
        self.fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            self._put(self.fd, 0, header)
            allocate(self.fd, len(header) + sum(t.nbytes for t in tensors), self.partial)
            self.offsets = data_offsets(self.partial, {t.name: t.nbytes for t in tensors})
            self.direct_fd = _open_direct(self.partial)
            self.direct = self.direct_fd is not None  # cleared if the file system refuses a direct write
        except BaseException:  # a full disk, say: no file left behind
            os.close(self.fd)
            self.partial.unlink(missing_ok=True)
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        with self._writing(self.offsets[name], tensor.view(-1).view(torch.uint8)):
            if self.digests:
                self.tensor_sha256[name] = hashlib.sha256(as_bytes(tensor)).digest()

    def copy_from(self, name: str, src_fd: int, src_offset: int, count: int, scratch: torch.Tensor,
                  check: Callable[[torch.Tensor], None] | None = None) -> None:
        """Copy tensor `name` from another file in chunks of at most COPY_BUFFER_BYTES, read into the
        flat byte tensor `scratch` (which has room for one chunk plus DIRECT_ALIGNMENT bytes: see
        `copy_scratch_bytes`); `check` sees each chunk."""
        digest, offset = hashlib.sha256(), self.offsets[name]
        size = min(count, COPY_BUFFER_BYTES)  # a multiple of DIRECT_ALIGNMENT when there are several chunks
        buffer = placed(scratch, 0, size, offset)
        while count:
            chunk = buffer[:min(count, size)]
            read_into(src_fd, src_offset, chunk)
            if check is not None:
                check(chunk)
            with self._writing(offset, chunk):
                digest.update(as_bytes(chunk))
            src_offset, offset, count = src_offset + len(chunk), offset + len(chunk), count - len(chunk)
        self.tensor_sha256[name] = digest.digest()

    @contextmanager
    def _writing(self, offset: int, data: torch.Tensor):
        """Around work that needs no disk (hashing `data`): write the bytes `data` at `offset`, their
        whole pages direct where they line up (`placed`), else all of them written behind."""
        view, count = as_bytes(data), len(data)
        head = -offset % DIRECT_ALIGNMENT
        body = max(0, count - head) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
        lined_up = (self.direct and count >= DIRECT_MIN_BYTES and body > 0
                    and (data.data_ptr() + head) % DIRECT_ALIGNMENT == 0)
        if lined_up and self._write_direct(offset + head, view[head:head + body]):
            self._put(self.fd, offset, view[:head])
            self._put(self.fd, offset + head + body, view[head + body:])
            yield
            return
        self._put(self.fd, offset, view)
        with written_behind(self.fd, offset, count):
            yield

    def _write_direct(self, offset: int, view: memoryview) -> bool:
        """Write whole pages around the page cache; False (and no more direct writes to this shard)
        where the file system opened the file for that but refuses the write (EINVAL: it wants larger
        alignment, say)."""
        try:
            self._put(self.direct_fd, offset, view)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            self.direct = False  # the descriptor stays open until finish: another worker may be using it
            return False
        return True

    def _put(self, fd: int, offset: int, view: memoryview | bytes) -> None:
        """`write_all_at`, a failing write (a full disk, say) named by the shard it was for."""
        try:
            write_all_at(fd, offset, view)
        except OSError as error:
            if error.filename is not None:
                raise
            raise OSError(error.errno, error.strerror, str(self.path)) from None

    def tensor_sha256s(self) -> list[bytes]:
        """The sha256 of every tensor, in file order (all of them must have been written)."""
        return [self.tensor_sha256[name] for name in self.offsets]

    def finish(self) -> None:
        self._close()
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        self._close()
        self.partial.unlink(missing_ok=True)

    def _close(self) -> None:
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)
