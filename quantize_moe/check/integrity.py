"""`verify`'s integrity check: every file the run's manifest lists still has its size and digest, and
the run finished. Hashing the output is most of a plain `verify` of a large checkpoint, so the check is
started first (`IntegrityCheck(folder)`, torch-free) and the files hash on every core while torch is
imported and the other checks run; `finding` collects it where it stands among them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from quantize_moe.check.findings import Finding, finding
from quantize_moe.errors import UserError
from quantize_moe.source.locations import inside
from quantize_moe.write.destination import MANIFEST_NAME
from quantize_moe.write.manifest import Manifest

if TYPE_CHECKING:
    from quantize_moe.source.checkpoint import Checkpoint


class IntegrityCheck:
    """Reads DST's manifest and starts hashing the files it lists; `finding` waits for the hashes. Use it
    as a context, so that leaving it (verify refused early) stops the hashing."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._manifest = self._matching = self._error = None
        try:
            self._manifest = Manifest.load(self.folder)
            if self._manifest is not None:
                for name in self._manifest.files:
                    inside(self.folder, name, f"'{self._manifest.path}'")
                self._matching = self._manifest.start_matching(self._manifest.files)
        except (UserError, OSError) as e:  # reported by `finding`, after the checks before it
            self._error = e

    def finding(self, checkpoint: Checkpoint) -> Finding:
        """The finding, once every listed file is hashed. Shard sizes against their own headers are
        already checked when the checkpoint is opened."""
        if self._error is not None:
            if self._manifest is None and isinstance(self._error, UserError):  # a damaged manifest
                return Finding("integrity", "fail", str(self._error))
            raise self._error
        manifest = self._manifest
        if manifest is None:
            return Finding("integrity", "warn", f"no {MANIFEST_NAME} (not written by quantize-moe?): shard "
                           "sizes match their headers, hashes not checked")
        intact = self._matching.result()
        problems = [f"'{name}' is missing or no longer has its size and digest from the manifest"
                    for name in sorted(manifest.files) if name not in intact]
        if not manifest.complete:
            problems.append("the manifest says the run did not finish; rerun quantize with --resume")
        problems += [f"shard '{f}' is not in the manifest" for f in checkpoint.shard_files
                     if f not in manifest.files]
        return finding("integrity", problems, f"{len(manifest.files)} files match the sizes and digests of "
                       f"{MANIFEST_NAME}", "integrity problem(s)")

    def __enter__(self) -> IntegrityCheck:
        return self

    def __exit__(self, *exc) -> None:
        """Stop hashing: verify ended, before this check or after it."""
        if self._matching is not None:
            self._matching.cancel()
