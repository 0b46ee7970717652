"""`evaluate`: the original and the FP8 model streamed layer by layer over the same tokens, compared where a
user sees them: perplexity of each and their ratio, KL(bf16 || fp8) per token, top-1 agreement, and where
the error comes from: the relative error of the hidden states after each decoder layer."""

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
class LayerError:
    layer: int
    relative_error: float  # ||h_fp8 - h_bf16|| / ||h_bf16|| over every token, after this decoder layer


@dataclass
class EvalReport:
    tokens: int
    src_perplexity: float
    dst_perplexity: float
    perplexity_ratio: float
    mean_kl: float
    top1_agreement: float
    passed: bool
    layers: list[LayerError]

    def to_json(self) -> dict:
        return asdict(self)


def evaluate(src: Path, dst: Path, batches: list[torch.Tensor], device: str = "cpu",
             thresholds: EvalThresholds = EvalThresholds()) -> EvalReport:
    """Stream both models side by side, layer by layer and then batch by batch. Each model frees its layer
    before handing over its hidden states, so memory holds one layer at a time, both models' hidden
    states, and one batch of logits of each, never N x T x V. Both checkpoints are closed on every path."""
    with Checkpoint(src) as src_checkpoint, Checkpoint(dst) as dst_checkpoint:
        original = LayerStreamedModel(SourceReader(src_checkpoint), device)
        quantized = LayerStreamedModel(SourceReader(dst_checkpoint), device)
        if len(original.layers) != len(quantized.layers):
            raise UserError(f"SRC '{src}' has {len(original.layers)} decoder layers and DST '{dst}' "
                            f"{len(quantized.layers)}; is DST made from SRC?")
        layers, ref_hidden, hidden = [], [], []
        for (index, ref_hidden), (_, hidden) in zip(original.hidden_states(batches), quantized.hidden_states(batches)):
            error = sum((h.float() - r.float()).square().sum() for h, r in zip(hidden, ref_hidden))
            norm = sum(r.float().square().sum() for r in ref_hidden)
            layers.append(LayerError(index, (error / norm.clamp_min(1e-30)).sqrt().item()))
        nll_src = nll_dst = kl = agree = 0.0
        count = 0
        for batch, ref, logits in zip(batches, original.head(ref_hidden), quantized.head(hidden)):
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
    return EvalReport(count, src_ppl, dst_ppl, ratio, mean_kl, top1, passed, layers)
