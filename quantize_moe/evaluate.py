"""Held-out perplexity of a byte-level causal LM: the accuracy check on trained fixtures."""

from __future__ import annotations

import math

import torch


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
