"""Lazy, read-only access to a safetensors checkpoint folder.

Only headers are read when the checkpoint is opened; tensor data is memory-mapped
by safetensors when a tensor is asked for, so a checkpoint far larger than RAM can
be walked one small group of tensors at a time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from quantize_moe.errors import UserError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

# safetensors dtype strings as reported by get_slice().get_dtype()
_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # shard file name, relative to the checkpoint folder
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


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
    if os.path.isabs(relative) or ".." in Path(relative).parts:
        raise UserError(f"{what} names the file '{relative}', which is outside the checkpoint folder; "
                        "fix it so it names files inside the folder.")
    path = folder / relative
    real = path.resolve()
    if not any(real.is_relative_to(root) for root in allowed_roots(folder)):
        raise UserError(f"'{path}' links outside the checkpoint folder '{folder}'; "
                        "copy the real file into the folder.")
    return path


class Checkpoint:
    """A checkpoint folder: config.json plus sharded or single-file safetensors."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise UserError(f"Checkpoint folder '{self.folder}' does not exist or is not a folder.")
        self.tensors: dict[str, TensorInfo] = self._read_headers(self._shard_map())
        self._handles: dict[str, object] = {}

    @cached_property
    def raw_config(self) -> dict:
        path = self.folder / CONFIG_NAME
        if not path.is_file():
            raise UserError(f"'{path}' is missing; a Hugging Face checkpoint folder needs its config.json.")
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"'{path}' is not valid JSON ({e}); restore the original config.json.") from None
        if not isinstance(config, dict):
            raise UserError(f"'{path}' does not hold a JSON object; restore the original config.json.")
        return config

    @property
    def shard_files(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})

    @property
    def weight_files(self) -> set[str]:
        """Files that make up the weights (shards and index): never copied as-is."""
        files = set(self.shard_files)
        if (self.folder / INDEX_NAME).exists():
            files.add(INDEX_NAME)
        return files

    def _shard_map(self) -> dict[str, list[str]]:
        """Shard file -> tensor names it should hold, from the index or the single file."""
        index_path = self.folder / INDEX_NAME
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                raise UserError(f"'{index_path}' is not a valid safetensors index (no 'weight_map' object); "
                                "restore it from the original checkpoint.") from None
            shards: dict[str, list[str]] = {}
            for name, file in weight_map.items():
                if not isinstance(file, str):
                    raise UserError(f"'{index_path}' maps tensor '{name}' to a non-string file name.")
                shards.setdefault(file, []).append(name)
            return shards
        if (self.folder / SINGLE_NAME).is_file():
            return {SINGLE_NAME: []}
        if any(self.folder.glob("*.bin")) or any(self.folder.glob("*.pt")):
            raise UserError(f"'{self.folder}' holds only pickle weights (.bin/.pt); quantize-moe reads "
                            "safetensors only: convert the checkpoint to safetensors first.")
        raise UserError(f"'{self.folder}' has neither {INDEX_NAME} nor {SINGLE_NAME}; "
                        "point SRC at a Hugging Face checkpoint folder.")

    def _read_headers(self, shards: dict[str, list[str]]) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for file, expected in sorted(shards.items()):
            path = inside(self.folder, file, f"'{INDEX_NAME}'")
            if not path.is_file():
                raise UserError(f"The index names shard '{file}', which is missing from '{self.folder}'; "
                                "download the missing shard.")
            try:
                with safe_open(path, framework="pt") as f:
                    names = list(f.keys())
                    for name in names:
                        sl = f.get_slice(name)
                        dtype = _DTYPES.get(sl.get_dtype())
                        if dtype is None:
                            raise UserError(f"Tensor '{name}' in '{path}' has dtype {sl.get_dtype()}, "
                                            "which quantize-moe does not read.")
                        if name in tensors:
                            raise UserError(f"Tensor '{name}' is stored twice, in '{tensors[name].file}' and "
                                            f"'{file}'; remove the duplicate shard.")
                        tensors[name] = TensorInfo(name, file, dtype, tuple(sl.get_shape()))
            except SafetensorError as e:
                raise UserError(f"Shard '{path}' is not a readable safetensors file ({e}); "
                                "re-download it.") from None
            missing = [n for n in expected if n not in set(names)]
            if missing:
                raise UserError(f"The index says tensor '{missing[0]}' is in '{file}', but that file does "
                                "not hold it; re-download the shard or fix the index.")
        return tensors

    def get(self, name: str) -> torch.Tensor:
        """The tensor, memory-mapped: its bytes are read when first touched."""
        info = self.tensors[name]
        handle = self._handles.get(info.file)
        if handle is None:
            handle = safe_open(self.folder / info.file, framework="pt")
            self._handles[info.file] = handle
        return handle.get_tensor(name)

    def close(self) -> None:
        self._handles.clear()
