"""`evaluate`: the original and the FP8 model streamed layer by layer over the same tokens, compared where a
user sees them: perplexity of each and their ratio, KL(bf16 || fp8) per token, top-1 agreement."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quantize_moe.adapters.reader import SourceReader
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
