"""Where a checkpoint's files and tensors lie, from names and headers alone: the file names of a
Hugging Face checkpoint, the rule that every file its metadata names lies inside the folder, and each
tensor's byte range in a safetensors file. Nothing here imports torch, so `verify` starts hashing the
output (`check.integrity`) before torch is imported.

Headers are read through safetensors' numpy `safe_open`, which maps read-only and touches only the
header (its torch `safe_open` maps the file copy-on-write, which the kernel refuses for a shard larger
than the machine's memory). Where a tensor lies comes from `safe_open(...).offset_keys()` (tensors in
data order) and the format's rule that the data region holds them back to back with no gaps and ends
the file.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from safetensors import SafetensorError, safe_open

from quantize_moe.errors import UserError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
PICKLE_SINGLE_NAME = "pytorch_model.bin"
CONFIG_NAME = "config.json"
SHARD_NAME = re.compile(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)")  # save_pretrained's shards

HEADER_FRAMEWORK = "numpy"  # safe_open's read-only mapping: metadata of a shard of any size
# bytes per element of the safetensors dtypes read (the keys of tensor_bytes.SAFETENSORS_DTYPES)
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def allowed_roots(folder: Path) -> list[Path]:
    """Where files of a checkpoint may really live: the folder itself and, for a snapshot in
    huggingface_hub's cache (whose files are links into the repo's `blobs`), that blobs folder."""
    folder = folder.resolve()
    roots = [folder]
    if folder.parent.name == "snapshots":
        roots.append(folder.parent.parent / "blobs")
    return roots


def inside(folder: Path, relative: str, what: str) -> Path:
    """Resolve a file named by checkpoint metadata, refusing any path that leaves the folder."""
    if "\0" in relative:
        raise UserError(f"{what} names the file {relative!r}, which contains a NUL character; "
                        "fix it so it names files inside the folder.")
    if os.path.isabs(relative) or ".." in Path(relative).parts:
        raise UserError(f"{what} names the file '{relative}', which is outside the checkpoint folder; "
                        "fix it so it names files inside the folder.")
    path = folder / relative
    try:
        real = path.resolve(strict=path.is_symlink())
    except (OSError, RuntimeError):  # a dangling link, or a loop (RuntimeError before Python 3.13)
        raise UserError(f"'{path}' is a symbolic link that loops or leads nowhere; replace it with the "
                        "real file.") from None
    if not any(real.is_relative_to(root) for root in allowed_roots(folder)):
        raise UserError(f"'{path}' links outside the checkpoint folder '{folder}'; "
                        "copy the real file into the folder.")
    return path


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
    cannot read the file or it holds a dtype quantize-moe does not read."""
    try:
        with safe_open(path, framework=HEADER_FRAMEWORK) as f:
            order = f.offset_keys()
            slices = {name: f.get_slice(name) for name in order}
            sizes = {name: DTYPE_BYTES[s.get_dtype()] * math.prod(s.get_shape())
                     for name, s in slices.items()}
    except (SafetensorError, KeyError):
        return None
    return {name: (offset, sizes[name]) for name, offset in _offsets(path, order, sizes).items()}
