"""Token batches for a streamed run (`evaluate --data`, `quantize --calibration`): a safetensors file with
`input_ids` [N, T] (models without a tokenizer), or text / JSON lines (field "text") tokenized with SRC's
own tokenizer and cut into windows. Every problem with the file is one sentence naming the option."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from quantize_moe.errors import UserError


@dataclass(frozen=True)
class TokenOptions:
    """Which options name the file, the window length and the sample count in messages; `strict`: fewer
    samples than asked, or rows shorter than the length, are refused instead of used as they are."""

    data: str = "--data"
    length: str = "--length"
    samples: str = "--samples"
    strict: bool = False


def _read_safetensors(data: Path, flag: str) -> torch.Tensor:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        ids = load_file(data).get("input_ids")
    except (SafetensorError, OSError, ValueError) as error:
        raise UserError(f"{flag} '{data}' is not a readable safetensors file ({error}).") from None
    if ids is None or ids.dim() != 2 or ids.numel() == 0 or ids.dtype.is_floating_point:
        raise UserError(f"{flag} '{data}' needs a non-empty integer tensor 'input_ids' of shape [N, T].")
    return ids.long()


def _read_text(data: Path, flag: str) -> str:
    try:
        text = data.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"{flag} '{data}' cannot be read as text ({error}).") from None
    if not text.strip():
        raise UserError(f"{flag} '{data}' is empty; give it text to tokenize.")
    if data.suffix != ".jsonl":
        return text
    texts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise UserError(f"{flag} '{data}' line {number} is not a JSON object with a string field \"text\".")
        texts.append(record["text"])
    return "\n\n".join(texts)


def _tokenize(text: str, src: Path, data: Path, flag: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
    except Exception:  # no tokenizer files, or one transformers cannot build offline
        raise UserError(f"'{src}' has no tokenizer to tokenize {flag} '{data}'; give a safetensors file "
                        "with 'input_ids' instead.") from None
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def load_tokens(data: Path, src: Path, length: int, samples: int | None,
                flags: TokenOptions = TokenOptions()) -> list[torch.Tensor]:
    """Token batches `[1, length]`: the rows of `input_ids` (cut to `length` when `flags.strict`), or the
    tokenized text in windows of `length`; the first `samples` of them."""

    if not data.is_file():
        raise UserError(f"{flags.data} '{data}' does not exist or is not a file; give a text file or a "
                        "safetensors file with 'input_ids'.")
    if data.suffix == ".safetensors":
        rows = _read_safetensors(data, flags.data)
        if flags.strict and rows.shape[1] < length:
            raise UserError(f"{flags.data} '{data}' has sequences of {rows.shape[1]} tokens, shorter than "
                            f"{flags.length} {length}; give longer sequences or a smaller {flags.length}.")
        rows = rows[:, :length] if flags.strict else rows
    else:
        ids = _tokenize(_read_text(data, flags.data), src, data, flags.data)
        if len(ids) < length + 1:
            raise UserError(f"{flags.data} '{data}' has {len(ids)} tokens, fewer than one window of "
                            f"{flags.length} {length} + 1; give more text or a smaller {flags.length}.")
        rows = ids[: len(ids) // length * length].reshape(-1, length)
    if rows.shape[1] < 2:
        raise UserError(f"{flags.data} '{data}' has sequences of {rows.shape[1]} token; at least 2 are needed.")
    if flags.strict and samples and len(rows) < samples:
        raise UserError(f"{flags.data} '{data}' holds {len(rows)} sequences of {rows.shape[1]} tokens, fewer "
                        f"than {flags.samples} {samples}; give more data or a smaller {flags.samples}.")
    rows = rows[:samples] if samples else rows
    return [row[None] for row in rows]


def tokens_digest(batches: list[torch.Tensor]) -> str:
    """sha256 of the token ids and their batch shapes: what a calibrated output depends on."""
    digest = hashlib.sha256()
    for batch in batches:
        digest.update(str(tuple(batch.shape)).encode())
        digest.update(batch.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()
