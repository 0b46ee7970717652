"""Fingerprints of output files, as the manifest records them.

A safetensors shard's digest is the sha256 of a list of sha256s: that of its
header (every byte before the data), then that of each tensor's bytes, in file
order. Like a plain sha256 it covers every byte of the file, but its parts can
be computed in any order and at once: the engine hashes each tensor from the
buffer it writes, on the worker that produced it, and never reads a shard back
(a plain sha256 of a shard could only start once its last tensor was written,
since safetensors puts every scale before every FP8 weight). Any other file
gets a plain sha256.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from quantize_moe.source.locations import tensor_regions

READ_CHUNK_BYTES = 16 << 20


def shard_digest(header_sha256: bytes, tensor_sha256s: list[bytes]) -> str:
    """A shard's digest from the sha256 of its header and those of its tensors in file order."""
    return hashlib.sha256(header_sha256 + b"".join(tensor_sha256s)).hexdigest()


def _sha256_of_range(path: Path, offset: int, count: int) -> bytes:
    """sha256 of `count` bytes at `offset`, read with pread into one reused buffer (threads share nothing)."""
    digest, buffer = hashlib.sha256(), bytearray(min(count, READ_CHUNK_BYTES))
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        while count:
            n = os.preadv(fd, [view[:min(count, len(view))]], offset)
            if n == 0:
                raise EOFError(f"'{path}' ended {count} bytes early")
            digest.update(view[:n])
            offset, count = offset + n, count - n
    finally:
        os.close(fd)
    return digest.digest()


def _submit(pool: ThreadPoolExecutor, path: Path) -> tuple[bool, list[Future]]:
    """Queue the hashes one file's digest is made of: (is a shard, futures of its parts in file order)."""
    regions = tensor_regions(path) if path.suffix == ".safetensors" else None
    size = path.stat().st_size
    if regions is None:
        return False, [pool.submit(_sha256_of_range, path, 0, size)]
    data_start = size - sum(nbytes for _, nbytes in regions.values())
    ranges = [(0, data_start), *regions.values()]
    return True, [pool.submit(_sha256_of_range, path, offset, nbytes) for offset, nbytes in ranges]


class FileDigests:
    """The digests of `paths`, every header and tensor of every file hashed at once on a thread pool from
    construction on (hashlib releases the GIL on large buffers, so one thread per core hashes at the
    disk's rate), so the caller can do other work meanwhile; the digests are those of `file_digest`."""

    def __init__(self, paths: list[Path]):
        self._pool = ThreadPoolExecutor(os.cpu_count() or 1)
        try:
            self._queued = {path: _submit(self._pool, path) for path in paths}
        except BaseException:
            self.cancel()
            raise

    def result(self) -> dict[Path, str]:
        """Wait for every digest."""
        try:
            digests = {}
            for path, (is_shard, parts) in self._queued.items():
                hashes = [part.result() for part in parts]
                digests[path] = shard_digest(hashes[0], hashes[1:]) if is_shard else hashes[0].hex()
            return digests
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Drop the hashes not started (those running finish in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def file_digest(path: Path) -> str:
    """The digest of a file on disk (see the module docstring). A shard that safetensors cannot read
    gets the plain sha256 of its bytes, which matches no digest the engine records."""
    return FileDigests([path]).result()[path]
