"""The output folder: checks before anything is written, atomic file writes, copied extras.

Every file is written under a temporary name and renamed when complete; the
index and config.json come last, so a folder that looks complete is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from quantize_moe.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, inside
from quantize_moe.errors import UserError

# Files that are weights in some format: never copied into the output.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz")
PARTIAL_SUFFIX = ".partial"


def prepare_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse a DST that would touch SRC or clobber unrelated files; create it."""
    src_real, dst_real = src.resolve(), dst.resolve()
    if dst_real == src_real or dst_real.is_relative_to(src_real):
        raise UserError(f"DST '{dst}' is SRC or inside it; choose an output folder outside the checkpoint.")
    if src_real.is_relative_to(dst_real):
        raise UserError(f"SRC '{src}' is inside DST '{dst}'; choose an output folder that does not contain "
                        "the checkpoint.")
    if dst.exists() and not dst.is_dir():
        raise UserError(f"DST '{dst}' exists and is not a folder; choose a folder path.")
    if dst.is_dir() and any(dst.iterdir()):
        if not overwrite:
            raise UserError(f"DST '{dst}' is not empty; pass --overwrite to replace its checkpoint, or "
                            "choose an empty folder.")
        # A crash after this point must not leave an old index or config describing new shards.
        for stale in [INDEX_NAME, CONFIG_NAME, *(p.name for p in dst.glob("*.safetensors"))]:
            (dst / stale).unlink(missing_ok=True)
    dst.mkdir(parents=True, exist_ok=True)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    write(tmp)
    os.replace(tmp, path)


def write_shard(path: Path, tensors: dict) -> None:
    _atomic(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def write_json(path: Path, data: dict) -> None:
    _atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n"))


def copy_extra_files(checkpoint: Checkpoint, dst: Path) -> list[str]:
    """Copy every non-weight file of SRC (tokenizer, generation config, license, ...) unchanged."""
    copied = []
    for path in sorted(checkpoint.folder.rglob("*")):
        relative = path.relative_to(checkpoint.folder)
        if (path.is_dir() or any(part.startswith(".") for part in relative.parts)
                or relative.as_posix() in checkpoint.weight_files or relative.as_posix() == CONFIG_NAME
                or path.name.endswith(WEIGHT_SUFFIXES) or path.name.endswith(".index.json")):
            continue
        source = inside(checkpoint.folder, relative.as_posix(), "SRC")
        target = dst / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        _atomic(target, lambda tmp: shutil.copyfile(source, tmp))
        copied.append(relative.as_posix())
    return copied
