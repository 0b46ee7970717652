"""The manifest: which output files of a run are finished, with their sizes and digests.

It lives in DST as `quantize-moe-manifest.json` and is rewritten (atomically) after
every output shard is renamed into place, so after a kill at any point it lists
exactly the shards that are whole. `--resume` keeps a shard only when the manifest
lists it and the file on disk still has that size and digest (`quantize_moe.write.digests`:
a sha256 of the file, or for a shard one over its header and tensors); everything else is
written again. When the run ends the manifest lists every file of the checkpoint
and says `complete`, so a truncated or altered file is detectable later.

The manifest holds nothing of its own that differs between runs (no times of
the run, no absolute paths), so a resumed run ends byte-identical to an
uninterrupted one. Its `run` fingerprint covers the options, config, layout and
quantize-moe version, and its `source` record each shard of SRC as the run found
it (`source_records`: size, modification time and a digest of its header and
sampled data); resuming after either changed is refused, naming what changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quantize_moe import __version__
from quantize_moe.write.digests import FileDigests, file_digest
from quantize_moe.errors import UserError
from quantize_moe.write.destination import MANIFEST_NAME, write_json

if TYPE_CHECKING:  # torch-free at import, so verify's integrity check starts hashing before torch is imported
    from quantize_moe.plan.plan import Plan
    from quantize_moe.source.checkpoint import Checkpoint

SAMPLES_PER_SHARD, SAMPLE_BYTES = 16, 64 << 10  # 1 MiB read per source shard, spread over its data


@dataclass(frozen=True)
class FileRecord:
    size: int
    digest: str

    @classmethod
    def of(cls, path: Path) -> FileRecord:
        return cls(path.stat().st_size, file_digest(path))


def run_fingerprint(plan: Plan, calibration: str | None = None) -> str:
    """sha256 of everything the output bytes depend on but SRC's data: source metadata, config, options,
    layout, the calibration tokens' digest (static activations, KV-cache scales) and the tool version (the
    shards' bytes are `source_records`)."""
    checkpoint = plan.checkpoint
    source = {
        "version": __version__,
        "calibration": calibration,
        "config": checkpoint.raw_config,
        "options": asdict(plan.options),
        "tensors": [(t.name, t.file, str(t.dtype), list(t.shape)) for t in checkpoint.tensors.values()],
        "files": {f: checkpoint.shard_size(f) for f in checkpoint.shard_files},
        "shards": {name: [o.name for item in items for o in item.outputs]
                   for name, items in zip(plan.shard_names, plan.shards)},
    }
    return hashlib.sha256(json.dumps(source, sort_keys=True, default=str).encode()).hexdigest()


def source_records(checkpoint: Checkpoint) -> dict[str, list]:
    """Each source shard as this run reads it: size, modification time (ns) and the sha256 of its
    safetensors header plus SAMPLES_PER_SHARD evenly spread windows of its data, so that bytes changed
    under the same names and sizes are caught even when the time was kept (a copy with `cp -p`), at the
    cost of a few MiB read per shard. A Hub source streamed shard by shard is pinned by its commit."""
    commit = getattr(checkpoint, "commit", None)
    if not checkpoint.shards_stay_local:
        return {f: [checkpoint.shard_size(f), commit] for f in checkpoint.shard_files}
    return {f: _shard_record(checkpoint.shard_path(f)) for f in checkpoint.shard_files}


def _shard_record(path: Path) -> list:
    digest, fd = hashlib.sha256(), os.open(path, os.O_RDONLY)
    try:
        stat = os.fstat(fd)  # size and mtime of the one file that is read
        size = stat.st_size
        header_end = 0  # a pickle shard (--allow-pickle) is only sampled
        if path.suffix == ".safetensors":
            header_end = min(size, 8 + int.from_bytes(os.pread(fd, 8, 0), "little"))
            digest.update(os.pread(fd, header_end, 0))
        span = max(0, size - header_end - SAMPLE_BYTES)
        for i in range(SAMPLES_PER_SHARD):
            digest.update(os.pread(fd, SAMPLE_BYTES, header_end + span * i // max(1, SAMPLES_PER_SHARD - 1)))
    finally:
        os.close(fd)
    return [size, stat.st_mtime_ns, digest.hexdigest()]


class Manifest:
    """The finished files of one run in one DST (see the module docstring for the protocol)."""

    def __init__(self, dst: Path, run: str, files: dict[str, FileRecord] | None = None,
                 complete: bool = False, source: dict[str, list] | None = None):
        self.dst, self.run, self.complete = dst, run, complete
        self.files: dict[str, FileRecord] = dict(files or {})
        self.source: dict[str, list] = dict(source or {})

    @property
    def path(self) -> Path:
        return self.dst / MANIFEST_NAME

    @classmethod
    def load(cls, dst: Path) -> Manifest | None:
        """The manifest in DST, None when there is none; a damaged one is an error."""
        path = dst / MANIFEST_NAME
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            files = {name: FileRecord(int(r["size"]), str(r["digest"])) for name, r in data["files"].items()}
            source = data.get("source", {})
            if not isinstance(source, dict):
                raise TypeError
            return cls(dst, str(data["run"]), files, bool(data["complete"]), source)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UserError(f"'{path}' is damaged; rerun with --overwrite instead of --resume.") from None

    @classmethod
    def for_run(cls, dst: Path, run: str, resume: bool, source: dict[str, list]) -> Manifest:
        """A fresh manifest, or with `resume` the one in DST after checking it belongs to this run and
        that SRC's shards are still those it was written from (`source_records`)."""
        found = cls.load(dst) if resume else None
        if found is None:
            return cls(dst, run, source=source)
        if found.run != run:
            raise UserError(f"'{found.path}' was written for a different SRC, options or quantize-moe version; "
                            "rerun with the original arguments, or with --overwrite to start over.")
        changed = sorted(f for f in source.keys() | found.source.keys() if source.get(f) != found.source.get(f))
        if changed:
            raise UserError(f"SRC's shard '{changed[0]}' changed since the run in '{dst}' was interrupted (its "
                            "size, modification time or bytes differ), so the finished shards may not belong to "
                            "it; rerun with --overwrite to start over.")
        found.complete = False  # until this run finishes again
        return found

    def matching(self, names) -> set[str]:
        """Those of `names` that are listed and still have their recorded size and digest in DST (a
        finished shard when resuming, an intact file when checking a finished checkpoint), hashed all
        at once across files and cores."""
        return self.start_matching(names).result()

    def start_matching(self, names) -> Matching:
        """`matching`, started: the files hash in the background until its `result` is asked for."""
        sized = {name: record for name in names if (record := self.files.get(name)) is not None
                 and (self.dst / name).is_file() and (self.dst / name).stat().st_size == record.size}
        return Matching(self.dst, sized, FileDigests([self.dst / name for name in sized]))

    @property
    def finished_bytes(self) -> int:
        """Bytes of listed files that are on disk with their recorded size (hashes are checked later,
        by `matching`)."""
        return sum(r.size for name, r in self.files.items()
                   if (self.dst / name).is_file() and (self.dst / name).stat().st_size == r.size)

    def record(self, name: str, digest: str | None = None) -> None:
        """Call after `name` is renamed into place in DST: from now on it counts as finished. `digest`
        is the one the writer computed; without it the file is read to compute it."""
        path = self.dst / name
        self.files[name] = FileRecord(path.stat().st_size, digest) if digest else FileRecord.of(path)
        self.save()

    def finish(self, names: list[str]) -> None:
        """Record the remaining files (index, config, copies) and mark the run complete."""
        for name in names:
            self.files[name] = FileRecord.of(self.dst / name)
        self.complete = True
        self.save()

    def save(self) -> None:
        files = {name: asdict(self.files[name]) for name in sorted(self.files)}
        write_json(self.path, {"quantize_moe": __version__, "run": self.run, "complete": self.complete,
                               "source": self.source, "files": files})


@dataclass(frozen=True)
class Matching:
    """`Manifest.matching` under way: the files of `records` (those on disk with their recorded size)
    are hashing in the background."""
    dst: Path
    records: dict[str, FileRecord]
    digests: FileDigests

    def result(self) -> set[str]:
        """The names whose digest is the recorded one (waits for the hashes)."""
        digests = self.digests.result()
        return {name for name, record in self.records.items() if digests[self.dst / name] == record.digest}

    def cancel(self) -> None:
        self.digests.cancel()
