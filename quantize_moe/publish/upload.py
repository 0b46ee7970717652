"""Publish a produced checkpoint to the Hub: create the repo, write the card, upload resumably.

huggingface_hub's `upload_folder` is resumable: files already committed are skipped
and data already uploaded is deduplicated, so re-running the same command after an
interruption continues where it stopped.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi, get_token

from quantize_moe import __version__
from quantize_moe.errors import UserError
from quantize_moe.source.hub import HubSource, hub_errors
from quantize_moe.write.manifest import Manifest
from quantize_moe.publish.model_card import write_card
from quantize_moe.write.destination import PARTIAL_SUFFIX

# hidden entries (streaming scratch, huggingface_hub's own state) and half-written files stay local
NOT_UPLOADED = [".*", "*/.*", f"*{PARTIAL_SUFFIX}"]


def upload(dst: Path, repo_id: str, *, private: bool = False) -> str:
    """Upload DST to model repo `repo_id` (created if missing, private if asked) and return the commit URL."""
    if not dst.is_dir():
        raise UserError(f"DST '{dst}' does not exist or is not a folder; point upload at a quantized checkpoint.")
    if get_token() is None:
        raise UserError("No Hugging Face token found; set HF_TOKEN or run `hf auth login`, then upload again.")
    manifest = Manifest.load(dst)
    if manifest is not None and not manifest.complete:
        raise UserError(f"'{manifest.path}' says the run that wrote DST did not finish; rerun quantize with "
                        "--resume before uploading.")
    write_card(dst, repo_id)
    api = HfApi()
    with hub_errors(HubSource(repo_id)):
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=dst, ignore_patterns=NOT_UPLOADED,
                                   commit_message=f"FP8 checkpoint made with quantize-moe {__version__}")
    return commit.commit_url
