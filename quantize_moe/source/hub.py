"""A Hugging Face Hub repo as SRC: downloaded into the cache, or streamed shard by shard.

Everything goes through huggingface_hub, so HF_TOKEN, HF_HOME, HF_ENDPOINT and
HF_HUB_OFFLINE mean here what they mean to every other Hub tool. Only what a
checkpoint needs is fetched: safetensors shards and index, configs, tokenizer,
chat template, card and license; never pickle weights or `original/` copies.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download, try_to_load_from_cache
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, NotASafetensorsRepoError,
                                    OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

from quantize_moe.source.checkpoint import SAFETENSORS_DTYPES, Checkpoint, TensorInfo
from quantize_moe.source.locations import INDEX_NAME
from quantize_moe.errors import UserError

SMALL_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.md", "LICENSE*", "*.py"]
WEIGHTS = ["*.safetensors"]
NOT_NEEDED = ["original/*", ".*"]
# org/name, optionally @revision (branch, tag or commit)
_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


@dataclass(frozen=True)
class HubSource:
    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def parse_source(text: str) -> Path | HubSource:
    """A local folder when one exists at `text`, else a Hub repo id `org/name[@revision]`. A repo id starts
    with a letter or digit and has one `/`; a text that does not (`./models/x`, `/data/x`, `a/b/c`) or
    whose `org` is a local folder (`models/mixtrl` beside `models/`) is a local path, so a typo in it
    says there is no such folder instead of asking the Hub."""
    path = Path(text)
    match = _REPO_ID.match(text)
    if path.exists() or match is None or Path(match["repo"].split("/")[0]).is_dir():
        return path
    return HubSource(match["repo"], match["revision"])


@contextlib.contextmanager
def hub_errors(source: HubSource):
    """Turn huggingface_hub's exceptions into one sentence that says what to do (never the token)."""
    try:
        yield
    except (OfflineModeIsEnabled, LocalEntryNotFoundError):
        raise UserError(f"'{source}' is neither a local folder nor (completely) in the Hugging Face cache "
                        f"'{constants.HF_HUB_CACHE}', and the Hub cannot be reached (HF_HUB_OFFLINE or no network); download it once "
                        "with network access.") from None
    except GatedRepoError:
        raise UserError(f"'{source.repo_id}' is gated: accept its conditions on the Hub, then set HF_TOKEN "
                        "or run `hf auth login`.") from None
    except RevisionNotFoundError:
        raise UserError(f"'{source.repo_id}' has no revision '{source.revision}'; name an existing branch, "
                        "tag or commit after the '@'.") from None
    except RepositoryNotFoundError:
        raise UserError(f"'{source}' is not a Hub repo you can access (nor a local folder); check the repo id "
                        "or path, and set HF_TOKEN for a private repo.") from None
    except NotASafetensorsRepoError:
        raise UserError(f"'{source}' has no model.safetensors or model.safetensors.index.json; quantize-moe "
                        "reads safetensors checkpoints only.") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "an error"
        raise UserError(f"The Hub answered {status} for '{source}'; check HF_TOKEN and HF_ENDPOINT, "
                        "or try again later.") from None


def download(source: HubSource, *, weights: bool = True) -> Path:
    """Download what the checkpoint needs into the Hugging Face cache; the snapshot folder."""
    with hub_errors(source):
        return Path(snapshot_download(source.repo_id, revision=source.revision, ignore_patterns=NOT_NEEDED,
                                      allow_patterns=SMALL_FILES + (WEIGHTS if weights else [])))


class StreamedCheckpoint(Checkpoint):
    """A Hub checkpoint read shard by shard.

    Headers come from the Hub by HTTP range requests; each shard is downloaded into
    `scratch` when its first tensor is read and deleted when its last one has been,
    so the disk holds a few shards at a time, never the whole model. Shards already
    in the cache are read there and left alone.
    """

    shards_stay_local = False  # read through `get`, which frees each shard after its last tensor

    def __init__(self, snapshot: Path, source: HubSource, commit: str, headers: dict[str, TensorInfo],
                 sizes: dict[str, int], scratch: Path):
        self.source, self.commit, self.scratch, self._headers, self._sizes = source, commit, scratch, headers, sizes
        super().__init__(snapshot)
        self._unread = Counter(info.file for info in headers.values())
        self._paths: dict[str, Path] = {}
        self._downloaded: set[str] = set()  # on disk in scratch, not yet deleted
        self.peak_shards_on_disk = 0

    def _shard_map(self, allow_pickle: bool) -> tuple[str | None, dict[str, list[str]]]:
        """The shards are on the Hub, not in the snapshot: only the index's name is local."""
        return (INDEX_NAME if (self.folder / INDEX_NAME).is_file() else None), {}

    def _read_headers(self, shards: dict[str, list[str]]) -> dict[str, TensorInfo]:
        return self._headers

    def shard_size(self, file: str) -> int:
        return self._sizes[file]

    @classmethod
    def open(cls, source: HubSource, scratch: Path) -> StreamedCheckpoint:
        api = HfApi()
        with hub_errors(source):
            commit = api.repo_info(source.repo_id, revision=source.revision).sha
            pinned = HubSource(source.repo_id, commit)  # one commit throughout, even if the branch moves
            snapshot = download(pinned, weights=False)
            metadata = api.get_safetensors_metadata(source.repo_id, revision=commit)
            sizes = {f.path: f.size for f in api.get_paths_info(source.repo_id, sorted(metadata.files_metadata),
                                                                revision=commit)}
        tensors = {}
        for name, file in metadata.weight_map.items():
            header = metadata.files_metadata[file].tensors.get(name)
            if header is None:
                raise UserError(f"The index of '{source}' says tensor '{name}' is in '{file}', but that file does "
                                "not hold it; the repo is broken.")
            dtype = SAFETENSORS_DTYPES.get(header.dtype)
            if dtype is None:
                raise UserError(f"Tensor '{name}' in '{file}' of '{source}' has dtype {header.dtype}, which "
                                "quantize-moe does not read.")
            tensors[name] = TensorInfo(name, file, dtype, tuple(header.shape))
        return cls(snapshot, source, commit, tensors, sizes, scratch)

    def shard_path(self, file: str) -> Path:
        if file not in self._paths:
            cached = try_to_load_from_cache(self.source.repo_id, file, revision=self.commit)
            if isinstance(cached, str):
                self._paths[file] = Path(cached)
            else:
                with hub_errors(self.source):
                    self._paths[file] = Path(hf_hub_download(self.source.repo_id, file, revision=self.commit,
                                                             local_dir=self.scratch))
                self._downloaded.add(file)
                self.peak_shards_on_disk = max(self.peak_shards_on_disk, len(self._downloaded))
        return self._paths[file]

    def get(self, name: str):
        tensor = super().get(name)
        file = self.tensors[name].file
        self._unread[file] -= 1
        if self._unread[file] == 0:
            self._free(file)
        return tensor

    def _free(self, file: str) -> None:
        """Forget the shard; tensors already read keep its bytes mapped until they are dropped."""
        self._handles.pop(file, None)
        if file in self._downloaded:
            self._paths[file].unlink()
            self._downloaded.discard(file)

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def open_source(text: str, *, stream: bool = False, scratch: Path | None = None,
                allow_pickle: bool = False) -> Checkpoint:
    """SRC as a Checkpoint: a local folder, a Hub repo in the cache, or a Hub repo streamed into `scratch`.
    Offline, streaming has nothing to download, so the cached snapshot is read in place. Pickle weights
    are never downloaded: `allow_pickle` concerns local folders only."""
    source = parse_source(text)
    if isinstance(source, Path):
        return Checkpoint(source, allow_pickle=allow_pickle)
    if stream and not constants.is_offline_mode():
        return StreamedCheckpoint.open(source, scratch)
    return Checkpoint(download(source))
