"""The output folder: checks before anything is written, atomic file writes, copied extras.

Every file is written under a temporary name and renamed when complete; the
index and config.json come last, so a folder that looks complete is complete.
The checks here only read: a run that is refused has written nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from quantize_moe.source.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, inside
from quantize_moe.console import human_bytes
from quantize_moe.errors import UsageError, UserError

# Files that are weights in some format: never copied into the output.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz")
PARTIAL_SUFFIX = ".partial"
MANIFEST_NAME = "quantize-moe-manifest.json"


def check_destination(src: Path, dst: Path, *, overwrite: bool, resume: bool) -> None:
    """Refuse a DST that would touch SRC or clobber unrelated files, before anything is written."""
    src_real, dst_real = src.resolve(), dst.resolve()
    if dst_real == src_real or dst_real.is_relative_to(src_real):
        raise UserError(f"DST '{dst}' is SRC or inside it; choose an output folder outside the checkpoint.")
    if src_real.is_relative_to(dst_real):
        raise UserError(f"SRC '{src}' is inside DST '{dst}'; choose an output folder that does not contain "
                        "the checkpoint.")
    if overwrite and resume:
        raise UsageError("--overwrite starts over and --resume continues; pass only one of them.")
    if dst.exists() and not dst.is_dir():
        raise UserError(f"DST '{dst}' exists and is not a folder; choose a folder path.")
    if overwrite or not dst.is_dir():
        return
    contents = [p for p in dst.iterdir() if not p.name.endswith(PARTIAL_SUFFIX)]
    # The manifest is the first file a run writes: a DST we touched holds it or its temporary.
    ours = (dst / MANIFEST_NAME).is_file() or (dst / (MANIFEST_NAME + PARTIAL_SUFFIX)).is_file()
    if resume and contents and not ours:
        raise UserError(f"DST '{dst}' has no {MANIFEST_NAME} to resume from; pass --overwrite to start "
                        "over, or choose an empty folder.")
    if not resume and ours:
        raise UserError(f"DST '{dst}' holds an earlier quantize-moe run; pass --resume to continue it or "
                        "--overwrite to start over.")
    if not resume and any(dst.iterdir()):
        raise UserError(f"DST '{dst}' is not empty; pass --overwrite to replace its checkpoint, or "
                        "choose an empty folder.")


def replaced_files(dst: Path, *, overwrite: bool) -> list[Path]:
    """What `prepare_destination` removes: leftover temporaries, and with --overwrite the old checkpoint."""
    if not dst.is_dir():
        return []
    stale = list(dst.rglob(f"*{PARTIAL_SUFFIX}"))
    if overwrite:
        stale += [dst / n for n in (INDEX_NAME, CONFIG_NAME, MANIFEST_NAME) if (dst / n).is_file()]
        stale += list(dst.glob("*.safetensors"))
    return stale


def check_free_space(dst: Path, needed: int, freed: int) -> None:
    """Refuse to start a run that cannot fit on DST's file system."""
    existing = next(p for p in (dst, *dst.absolute().parents) if p.exists())
    free = shutil.disk_usage(existing).free + freed
    if free < needed:
        raise UserError(f"DST '{dst}' needs {human_bytes(needed)} but its file system has {human_bytes(free)} "
                        "free; free some space or choose another DST.")


def prepare_destination(dst: Path, *, overwrite: bool) -> None:
    """Create DST and remove what `replaced_files` lists. A crash after this point must not leave an old
    index or config describing new shards."""
    for path in replaced_files(dst, overwrite=overwrite):
        path.unlink()
    dst.mkdir(parents=True, exist_ok=True)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    write(tmp)
    os.replace(tmp, path)


def write_shard(path: Path, tensors: dict) -> None:
    """safetensors' save_file creates its file 0600; the shard gets the mode of every other output file."""
    def save(tmp: Path) -> None:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, new_file_mode())
    _atomic(path, save)


def new_file_mode() -> int:
    """The mode open() gives a new file under this process's umask (0644 under the usual 022)."""
    umask = os.umask(0o022)  # reading the umask means setting it; set it straight back
    os.umask(umask)
    return 0o666 & ~umask


def write_text(path: Path, text: str) -> None:
    _atomic(path, lambda tmp: tmp.write_text(text))


def write_json(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def extra_files(checkpoint: Checkpoint) -> list[str]:
    """Every non-weight file of SRC (tokenizer, generation config, license, ...), relative to it; each
    is checked to really live in the checkpoint folder."""
    extras = []
    for path in sorted(checkpoint.folder.rglob("*")):
        relative = path.relative_to(checkpoint.folder)
        if (path.is_dir() or any(part.startswith(".") for part in relative.parts)
                or relative.as_posix() in checkpoint.weight_files or relative.as_posix() == CONFIG_NAME
                or path.name.endswith(WEIGHT_SUFFIXES) or path.name.endswith(".index.json")):
            continue
        inside(checkpoint.folder, relative.as_posix(), "SRC")
        extras.append(relative.as_posix())
    return extras


def copy_extra_files(checkpoint: Checkpoint, dst: Path, extras: list[str]) -> None:
    """Copy the files `extra_files` listed unchanged."""
    for relative in extras:
        target = dst / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        _atomic(target, lambda tmp: shutil.copyfile(checkpoint.folder / relative, tmp))
