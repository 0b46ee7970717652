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
from pathlib import Path

from quantize_moe.source.tensor_bytes import tensor_regions

READ_CHUNK_BYTES = 16 << 20


def shard_digest(header_sha256: bytes, tensor_sha256s: list[bytes]) -> str:
    """A shard's digest from the sha256 of its header and those of its tensors in file order."""
    return hashlib.sha256(header_sha256 + b"".join(tensor_sha256s)).hexdigest()


def _sha256_of_range(f, offset: int, count: int) -> bytes:
    digest = hashlib.sha256()
    f.seek(offset)
    while count:
        chunk = f.read(min(count, READ_CHUNK_BYTES))
        if not chunk:
            raise EOFError(f"'{f.name}' ended {count} bytes early")
        digest.update(chunk)
        count -= len(chunk)
    return digest.digest()


def file_digest(path: Path) -> str:
    """The digest of a file on disk (see the module docstring). A shard that safetensors cannot read
    gets the plain sha256 of its bytes, which matches no digest the engine records."""
    regions = tensor_regions(path) if path.suffix == ".safetensors" else None
    size = path.stat().st_size
    with open(path, "rb") as f:
        if regions is None:
            return _sha256_of_range(f, 0, size).hex()
        data_start = size - sum(nbytes for _, nbytes in regions.values())
        header = _sha256_of_range(f, 0, data_start)
        return shard_digest(header, [_sha256_of_range(f, offset, nbytes) for offset, nbytes in regions.values()])
