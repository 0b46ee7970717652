"""Tiny checkpoints of several families whose expert widths are multiples of 128 (so block FP8 applies),
with weights of several blocks per dimension, and some Linears that do not fit a block."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from quantize_moe.tiny import build_tiny_checkpoint

# hidden 256 x expert width 128: every expert weight spans a non-square grid of blocks ([1, 2] or [2, 1]).
BLOCK_FRIENDLY = {
    "mixtral": dict(hidden_size=256, intermediate_size=128),
    "qwen2_moe": dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256,
                      shared_expert_intermediate_size=256),
    "deepseek_v3": dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256, n_routed_experts=4,
                        num_key_value_heads=4, q_lora_rank=128),
}


def block_friendly_builder(root: Path):
    """A cached `family -> checkpoint folder` builder under `root`."""
    @cache
    def build(family: str) -> Path:
        return build_tiny_checkpoint(family, root / family, max_shard_size="1MB", **BLOCK_FRIENDLY[family])
    return build
