"""File integrity of a produced checkpoint: streamed hashes, the manifest, sizes from headers.

The manifest (sizes and sha256 of every output file) is written by the quantize
run; `verify` checks against it when present and otherwise checks each shard's
size against what its own safetensors header declares.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from quantize_moe.checkpoint import TensorInfo

MANIFEST_NAME = "quantize_moe_manifest.json"  # {"files": {relative path: {"size": int, "sha256": hex}}}
_READ_BYTES = 1 << 24


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 16 MB blocks so a 5 GB shard never sits in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(folder: Path) -> dict[str, dict] | None:
    """The manifest's per-file records, or None when the output has no manifest."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return None
    return json.loads(path.read_text())["files"]


def expected_shard_size(path: Path, tensors: list[TensorInfo]) -> int:
    """What a safetensors file's own header implies its size is: the 8-byte header length, the header,
    and the tensor bytes it declares (safetensors stores them densely)."""
    with open(path, "rb") as f:
        (header_bytes,) = struct.unpack("<Q", f.read(8))
    return 8 + header_bytes + sum(t.nbytes for t in tensors)
