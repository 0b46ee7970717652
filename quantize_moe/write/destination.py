"""The output folder: checks before anything is written, atomic file writes, copied extras.

Every file is written under a temporary name and renamed when complete; the
index and config.json come last, so a folder that looks complete is complete.
The checks here only read: a run that is refused has written nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError

from quantize_moe.source.locations import CONFIG_NAME, INDEX_NAME, inside
from quantize_moe.console import human_bytes
from quantize_moe.errors import UsageError, UserError

if TYPE_CHECKING:  # torch-free at import, for the manifest and verify's integrity check (started before torch)
    from quantize_moe.source.checkpoint import Checkpoint

# Files that are weights in some format: never copied into the output.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz")
PARTIAL_SUFFIX = ".partial"
MANIFEST_NAME = "quantize-moe-manifest.json"
RUN_RECORD = "quantize_moe_run.json"
CARD_NAME = "README.md"
VALIDATION_REPORT = "validation.json"  # written by `quantize-moe validate SRC DST --json-out DST/validation.json`
EVALUATION_REPORT = "evaluation.json"  # written by `quantize-moe evaluate SRC DST --card`
# What a run of ours adds beside the checkpoint: when SRC is such an output (a round trip through
# dequantize, or --requantize), these describe the old output and the new run writes its own.
RUN_FILES = (MANIFEST_NAME, RUN_RECORD, CARD_NAME, VALIDATION_REPORT, EVALUATION_REPORT)
OUTPUT_SHARD = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")  # the shard names this tool writes


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
    if overwrite:  # only what is ours: named as we name output files, or listed by our manifest
        ours = {n for n in os.listdir(dst) if n in (INDEX_NAME, CONFIG_NAME, MANIFEST_NAME) or OUTPUT_SHARD.fullmatch(n)}
        stale += [dst / n for n in sorted(ours | set(_listed_in_manifest(dst))) if (dst / n).is_file()]
    return stale


def _listed_in_manifest(dst: Path) -> list[str]:
    """The files an earlier run's manifest in DST lists, those really inside DST; none when it is unreadable
    (it is replaced anyway)."""
    try:
        files = json.loads((dst / MANIFEST_NAME).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    listed = []
    for name in files if isinstance(files, dict) else []:
        try:
            listed.append(inside(dst, name, f"'{dst / MANIFEST_NAME}'").relative_to(dst).as_posix())
        except (UserError, TypeError):
            continue
    return listed


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
    """`write(tmp)` then rename to `path`; a failing write (a full disk, say) leaves no temporary behind
    and is named by the file it was for."""
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    try:
        write(tmp)
    except (OSError, SafetensorError) as error:
        tmp.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror or str(error), str(path)) from None
        raise OSError(None, f"writing failed ({error})", str(path)) from None
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    _atomic(path, lambda tmp: tmp.write_text(text))


def write_json(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def extra_files(checkpoint: Checkpoint) -> list[str]:
    """Every non-weight file of SRC (tokenizer, generation config, license, ...), relative to it; each
    is checked to really live in the checkpoint folder. When SRC is an output of ours, its `RUN_FILES`
    are left out: they describe that output, not the one being written."""
    extras = []
    ours = RUN_FILES if (checkpoint.folder / MANIFEST_NAME).is_file() else ()
    for path in sorted(checkpoint.folder.rglob("*")):
        relative = path.relative_to(checkpoint.folder)
        if (path.is_dir() or any(part.startswith(".") for part in relative.parts) or relative.as_posix() in ours
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
