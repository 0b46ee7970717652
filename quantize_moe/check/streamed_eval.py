"""`evaluate`: the original and the FP8 model streamed layer by layer over the same tokens, compared where a
user sees them: perplexity of each and their ratio, KL(bf16 || fp8) per token, top-1 agreement."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quantize_moe.adapters.reader import SourceReader
from quantize_moe.errors import UserError
from quantize_moe.run.executor import LayerStreamedModel
from quantize_moe.source.checkpoint import Checkpoint


@dataclass
class EvalThresholds:
    max_perplexity_ratio: float = 1.02
    max_kl: float = 0.05
    min_top1: float = 0.9


@dataclass
class EvalReport:
    tokens: int
    src_perplexity: float
    dst_perplexity: float
    perplexity_ratio: float
    mean_kl: float
    top1_agreement: float
    passed: bool

    def to_json(self) -> dict:
        return asdict(self)


def load_tokens(data: Path, src: Path, length: int, samples: int | None) -> list[torch.Tensor]:
    """Token batches `[1, length]` from a safetensors file with `input_ids` [N, T], or from text
    tokenized with SRC's tokenizer and cut into windows of `length`."""
    if not data.is_file():
        raise UserError(f"--data '{data}' does not exist or is not a file; give a text file or a safetensors "
                        "file with 'input_ids'.")
    if data.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            ids = load_file(data).get("input_ids")
        except (SafetensorError, OSError, ValueError) as error:
            raise UserError(f"--data '{data}' is not a readable safetensors file ({error}).") from None
        if ids is None or ids.dim() != 2 or ids.numel() == 0 or ids.dtype.is_floating_point:
            raise UserError(f"--data '{data}' needs a non-empty integer tensor 'input_ids' of shape [N, T].")
        rows = ids.long()
    else:
        try:
            text = data.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"--data '{data}' cannot be read as text ({error}).") from None
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
        except Exception:  # no tokenizer files, or one transformers cannot build offline
            raise UserError(f"'{src}' has no tokenizer to tokenize --data '{data}'; give a safetensors file "
                            "with 'input_ids' instead.") from None
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        if len(ids) < length + 1:
            raise UserError(f"--data '{data}' has {len(ids)} tokens, fewer than one window of --length "
                            f"{length} + 1; give more text or a smaller --length.")
        rows = ids[: len(ids) // length * length].reshape(-1, length)
    if rows.shape[1] < 2:
        raise UserError(f"--data '{data}' has sequences of {rows.shape[1]} token; perplexity needs at least 2.")
    rows = rows[:samples] if samples else rows
    return [row[None] for row in rows]


def _streamed_logits(folder: Path, batches: list[torch.Tensor], device: str):
    reader = SourceReader(Checkpoint(folder))
    try:
        yield from LayerStreamedModel(reader, device).logits(batches)
    finally:
        reader.close()


def evaluate(src: Path, dst: Path, batches: list[torch.Tensor], device: str = "cpu",
             thresholds: EvalThresholds = EvalThresholds()) -> EvalReport:
    """Stream both models side by side and compare batch by batch. Each generator runs all its layers
    before its first batch of logits, so memory holds one layer at a time, both models' hidden states,
    and one batch of logits of each, never N x T x V."""
    nll_src = nll_dst = kl = agree = 0.0
    count = 0
    for batch, ref, logits in zip(batches, _streamed_logits(src, batches, device),
                                  _streamed_logits(dst, batches, device)):
        target = batch[:, 1:].to(logits.device).flatten()
        p_log = torch.log_softmax(ref[:, :-1], -1).flatten(0, 1)
        q_log = torch.log_softmax(logits[:, :-1], -1).flatten(0, 1)
        nll_src -= p_log.gather(1, target[:, None]).sum().item()
        nll_dst -= q_log.gather(1, target[:, None]).sum().item()
        kl += (p_log.exp() * (p_log - q_log)).sum().item()
        agree += (p_log.argmax(-1) == q_log.argmax(-1)).sum().item()
        count += target.numel()
    src_ppl, dst_ppl = math.exp(nll_src / count), math.exp(nll_dst / count)
    ratio, mean_kl, top1 = dst_ppl / src_ppl, kl / count, agree / count
    passed = (ratio <= thresholds.max_perplexity_ratio and mean_kl <= thresholds.max_kl
              and top1 >= thresholds.min_top1)
    return EvalReport(count, src_ppl, dst_ppl, ratio, mean_kl, top1, passed)
