"""Held-out perplexity of a byte-level causal LM: the accuracy check on trained fixtures."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from quantize_moe.plan.options import Options


@torch.no_grad()
def heldout_perplexity(model: torch.nn.Module, data: bytes, windows: int = 64, length: int = 512,
                       seed: int = 1) -> float:
    """exp(mean next-token loss) over `windows` random windows of `length` bytes (token id = byte)."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    offsets = torch.randint(0, len(tokens) - length - 1, (windows,), generator=torch.Generator().manual_seed(seed))
    total = 0.0
    for offset in offsets.tolist():
        window = tokens[offset:offset + length + 1][None]
        logits = model(input_ids=window[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
    return math.exp(total / (windows * length))


def fp8_perplexity(src: Path, data: bytes, options: Options, workdir: Path,
                   windows: int = 64) -> tuple[Options, str, float]:
    """Quantize `src` into `workdir` and measure the result through transformers' own loader, as a
    user would; a combination transformers cannot load goes through our dequantization first.
    Returns the resolved options, how the model was loaded, and the perplexity."""
    from transformers import AutoModelForCausalLM

    from quantize_moe.write.dequantize import dequantize_checkpoint
    from quantize_moe.plan.compatibility import loading_engines
    from quantize_moe.write.job import quantize_checkpoint

    plan = quantize_checkpoint(src, workdir / "fp8", options, show_progress=False).plan
    options, folder, how = plan.options, workdir / "fp8", "transformers"
    if "transformers" not in loading_engines(options.format, options.scheme, plan.family.name):
        dequantize_checkpoint(folder, workdir / "dequantized")
        folder, how = workdir / "dequantized", "dequantized, then transformers"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    return options, how, heldout_perplexity(model, data, windows)
