"""Lazy, read-only access to a safetensors checkpoint folder.

Only headers are read when the checkpoint is opened; a tensor's bytes are read by
range (`pread`) when it is asked for, never a whole shard mapped, so a checkpoint far
larger than RAM, with shards of any size, can be walked one small group of tensors at
a time. Everything on disk is untrusted:
every inconsistency between index, headers and file sizes is a `UserError` at open.
Pickle checkpoints are read only when the user allows it, and then weights-only.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from quantize_moe.errors import UserError
from quantize_moe.source.locations import (CONFIG_NAME, HEADER_FRAMEWORK, INDEX_NAME, PICKLE_INDEX_NAME,
                                           PICKLE_SINGLE_NAME, SHARD_NAME, SINGLE_NAME, data_offsets, inside)
from quantize_moe.source.tensor_bytes import SAFETENSORS_DTYPES, read_into

# Threads reading one stage's tensors at once: `read_into` is pread, which releases the GIL, so the disk
# (or the page cache) sees many reads in flight.
READ_THREADS = min(16, max(4, os.cpu_count() or 1))

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


class Checkpoint:
    """A checkpoint folder: config.json plus sharded or single-file safetensors (or, with
    `allow_pickle`, torch pickle shards loaded weights-only)."""

    # Shards stay on local disk for the whole run, so their bytes may be read directly (pread).
    shards_stay_local = True

    def __init__(self, folder: str | os.PathLike, *, allow_pickle: bool = False):
        self.folder = Path(folder)
        if not self.folder.exists():
            raise UserError(f"There is no folder named '{self.folder}'; check the path of the checkpoint.")
        if not self.folder.is_dir():
            raise UserError(f"'{self.folder}' is a file, not a checkpoint folder; name the folder that holds it.")
        self.index_name, shards = self._shard_map(allow_pickle)
        self._handles: dict[str, dict[str, torch.Tensor]] = {}  # pickle shard -> its loaded tensors
        self._offsets: dict[str, dict[str, int]] = {}  # safetensors shard -> where each tensor starts
        self.tensors: dict[str, TensorInfo] = self._read_headers(shards)

    @cached_property
    def raw_config(self) -> dict:
        path = self.folder / CONFIG_NAME
        if not path.is_file():
            raise UserError(f"'{path}' is missing; a Hugging Face checkpoint folder needs its config.json.")
        return read_json_object(self.folder, CONFIG_NAME, "restore the original config.json")

    @property
    def shard_files(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})

    @property
    def weight_files(self) -> set[str]:
        """Files that make up the weights (shards and index): never copied as-is."""
        files = set(self.shard_files)
        if self.index_name is not None:
            files.add(self.index_name)
        return files

    def _shard_map(self, allow_pickle: bool) -> tuple[str | None, dict[str, list[str]]]:
        """The index file (if any) and shard file -> tensor names it should hold."""
        if (self.folder / INDEX_NAME).is_file():
            return INDEX_NAME, self._read_index(INDEX_NAME)
        if (self.folder / SINGLE_NAME).is_file():
            return None, {SINGLE_NAME: []}
        for name in (PICKLE_INDEX_NAME, PICKLE_SINGLE_NAME):
            if (self.folder / name).is_file():
                if not allow_pickle:
                    raise UserError(f"'{self.folder}' holds only pickle weights ({name}), which can run code "
                                    "when loaded; pass --allow-pickle to load them weights-only, or convert "
                                    "the checkpoint to safetensors.")
                if name == PICKLE_INDEX_NAME:
                    return name, self._read_index(name)
                return None, {name: []}
        raise UserError(f"'{self.folder}' has neither {INDEX_NAME} nor {SINGLE_NAME}; "
                        "point SRC at a Hugging Face checkpoint folder.")

    def _read_index(self, index_name: str) -> dict[str, list[str]]:
        """Shard file -> tensor names, from an index whose shards must all be of the index's own kind:
        a safetensors index naming a `.bin` would otherwise reach torch.load without --allow-pickle."""
        index_path = self.folder / index_name
        weight_map = read_json_object(self.folder, index_name, "it is not a valid safetensors index, so "
                                      "restore it from the original checkpoint").get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"'{index_path}' is not a valid safetensors index (no 'weight_map' object); "
                            "restore it from the original checkpoint.")
        suffix = ".safetensors" if index_name == INDEX_NAME else ".bin"
        shards: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise UserError(f"'{index_path}' maps tensor '{name}' to a non-string file name; "
                                "restore it from the original checkpoint.")
            if not file.endswith(suffix):
                raise UserError(f"'{index_path}' maps tensor '{name}' to '{file}', which is not a {suffix} "
                                f"file; this index may only name {suffix} shards, so fix the index.")
            shards.setdefault(file, []).append(name)
        return shards

    def _read_headers(self, shards: dict[str, list[str]]) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        unlisted: list[tuple[str, str]] = []  # (shard, tensor) the index does not list
        for file, expected in sorted(shards.items()):
            path = inside(self.folder, file, f"'{self.folder / (self.index_name or file)}'")
            if path.exists() and not path.is_file():
                raise UserError(f"Shard '{path}' is not a regular file (a pipe, device or folder); replace it "
                                "with the real shard.")
            if not path.is_file():
                raise UserError(f"The index names shard '{file}', which is missing from '{self.folder}'; "
                                "download the missing shard.")
            _check_readable(path)
            found = _safetensors_header(path) if path.suffix == ".safetensors" else self._pickle_header(file)
            for name, (dtype, shape) in found.items():
                if name in tensors:
                    raise UserError(f"Tensor '{name}' is stored twice, in '{tensors[name].file}' and "
                                    f"'{file}'; remove the duplicate shard.")
                tensors[name] = TensorInfo(name, file, dtype, shape)
            missing = [n for n in expected if n not in found]
            if missing:
                raise UserError(f"The index says tensor '{missing[0]}' is in '{file}', but that file does "
                                "not hold it; re-download the shard or fix the index.")
            if self.index_name:
                unlisted += [(file, n) for n in found if n not in expected]
        if unlisted:
            file, name = unlisted[0]
            raise UserError(f"'{file}' holds tensor '{name}', which '{self.index_name}' does not list; the "
                            "index and its shards come from different saves: re-download both.")
        self._check_no_unlisted_shards(shards)
        return tensors

    def _check_no_unlisted_shards(self, shards: dict[str, list[str]]) -> None:
        """A shard file named like save_pretrained's shards that the index never mentions means the index
        and its shards disagree: reading only the listed ones would silently drop tensors."""
        if self.index_name is None:
            return
        for path in sorted(self.folder.iterdir()):
            if SHARD_NAME.fullmatch(path.name) and path.name not in shards:
                raise UserError(f"'{path}' is a shard that '{self.folder / self.index_name}' does not list; "
                                "the index and its shards come from different saves: re-download both.")

    def _pickle_header(self, file: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Load a pickle shard weights-only (memory-mapped when it is a zip archive, so nothing is
        read yet); the loaded dict is kept as the shard's handle."""
        path = self.folder / file
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
        except pickle.UnpicklingError:
            raise UserError(f"Pickle shard '{path}' holds more than plain tensors (loading it would build "
                            "objects or run code); convert the checkpoint to safetensors with a trusted "
                            "tool.") from None
        except Exception as e:  # torch raises many types for a damaged archive
            raise UserError(f"Pickle shard '{path}' is not a readable torch file ({type(e).__name__}); "
                            "re-download it.") from None
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise UserError(f"Pickle shard '{path}' is not a dict of tensors; point SRC at a checkpoint "
                            "saved with save_pretrained.")
        self._handles[file] = state
        return {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}

    def get(self, name: str) -> torch.Tensor:
        """The tensor, read by range into memory of its own (pickle shards: from the loaded dict)."""
        info = self.tensors[name]
        if info.file in self._handles:
            return self._handles[info.file][name]
        try:
            tensor = torch.empty(info.shape, dtype=info.dtype)
        except RuntimeError:  # the allocator refused: more than the machine holds
            raise UserError(f"Tensor '{name}' in '{self.shard_path(info.file)}' is {info.nbytes / 1e9:.1f} GB, more "
                            "than this machine can hold in memory; run on a machine with more memory, or check that "
                            "the shard is not damaged.") from None
        self.read_into(name, tensor)
        return tensor

    def readable_into(self, name: str, out: torch.Tensor) -> bool:
        """Whether `read_into(name, out)` can fill `out`: a safetensors tensor of out's dtype and size, and
        `out` contiguous (on any device)."""
        info = self.tensors[name]
        return (info.file not in self._handles and info.dtype == out.dtype and info.nbytes == out.nbytes and out.is_contiguous())

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill `out` (as `readable_into` says) with the tensor's bytes, with no tensor of its own in between;
        thread-safe (`pread`, which releases the GIL), so a layer's tensors can be read in parallel."""
        info = self.tensors[name]
        path = self.shard_path(info.file)
        if info.file not in self._offsets:
            self._offsets[info.file] = data_offsets(path, {t.name: t.nbytes for t in self.tensors.values()
                                                           if t.file == info.file})
        if out.numel():
            with open(path, "rb", buffering=0) as f:
                read_into(f.fileno(), self._offsets[info.file][name], out)

    def shard_path(self, file: str) -> Path:
        """Where the bytes of shard `file` are read from."""
        return self.folder / file

    def shard_size(self, file: str) -> int:
        return self.shard_path(file).stat().st_size

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_json_object(folder: Path, relative: str, fix: str) -> dict:
    """A JSON object from a metadata file of the checkpoint: one rule for every such read (the file
    must really live in the folder, as shards must) and one sentence for every way it can be bad."""
    path = inside(folder, relative, f"'{folder}'")
    try:
        data = json.loads(path.read_text())
    except PermissionError:
        raise UserError(f"'{path}' cannot be read (permission denied); make it readable.") from None
    except OSError as e:
        raise UserError(f"'{path}' cannot be read ({e.strerror or e}); {fix}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"'{path}' is not valid JSON ({e}); {fix}.") from None
    except RecursionError:
        raise UserError(f"'{path}' nests JSON too deeply to read; {fix}.") from None
    if not isinstance(data, dict):
        raise UserError(f"'{path}' does not hold a JSON object; {fix}.")
    return data


def _check_readable(path: Path) -> None:
    """A shard we may not read is named as such (safetensors would report it as missing)."""
    try:
        os.close(os.open(path, os.O_RDONLY))
    except PermissionError:
        raise UserError(f"Shard '{path}' cannot be read (permission denied); make it readable, e.g. "
                        "chmod a+r, or run as a user who may read it.") from None


def _safetensors_header(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Dtype and shape of every tensor in a safetensors shard, from its header alone."""
    try:
        with safe_open(path, framework=HEADER_FRAMEWORK) as f:
            found = {}
            for name in f.keys():
                sl = f.get_slice(name)
                dtype = SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise UserError(f"Tensor '{name}' in '{path}' has dtype {sl.get_dtype()}, which "
                                    "quantize-moe does not read; convert it to bf16, fp16 or fp32.")
                found[name] = (dtype, tuple(sl.get_shape()))
            return found
    except SafetensorError as e:
        declared = _declared_size(path)
        actual = path.stat().st_size
        if declared is not None and declared > actual:
            raise UserError(f"Shard '{path}' is truncated: its header declares {declared} bytes but the file "
                            f"has {actual}; re-download it.") from None
        if declared is not None and declared < actual:
            raise UserError(f"Shard '{path}' has {actual - declared} bytes beyond the {declared} its header "
                            "declares; re-download it.") from None
        raise UserError(f"Shard '{path}' is not a readable safetensors file ({e}); re-download it.") from None


def _declared_size(path: Path) -> int | None:
    """The file size a safetensors header declares (8-byte length, JSON header, data up to the last
    tensor's end offset), or None when the header itself is unreadable. Used only to explain why
    safetensors refused a shard: a truncated download and a corrupt header need different words."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(length, 100 * 2**20)))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        return 8 + length + int(end)
    except (struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError, OSError):
        return None
