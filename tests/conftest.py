"""Shared fixtures: tiny checkpoints of real families, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("COLUMNS", "200")  # rich wraps tables at 80 columns without a terminal

import pytest

from quantize_moe.source.tiny import build_tiny_checkpoint

SHARED_FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(model_type, **kwargs) -> folder; each distinct request is built once."""
    built: dict = {}

    def build(model_type: str, **kwargs) -> Path:
        key = (model_type, tuple(sorted(kwargs.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp(f"src-{model_type}")
            built[key] = build_tiny_checkpoint(model_type, folder, **kwargs)
        return built[key]

    return build


@pytest.fixture
def shared_fixtures() -> Path:
    if not (SHARED_FIXTURES / "tiny-mixtral-trained").is_dir():
        pytest.skip("../shared/fixtures is not present")
    return SHARED_FIXTURES


# hidden 256 x expert width 128: every expert weight spans a non-square grid of 128x128 blocks ([1, 2] or
# [2, 1]), so block FP8 applies; some attention Linears still break blocks and stay in bf16.
BLOCK_FRIENDLY = {
    "mixtral": dict(hidden_size=256, intermediate_size=128),
    "qwen2_moe": dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256,
                      shared_expert_intermediate_size=256),
    "deepseek_v3": dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256, n_routed_experts=4,
                        num_key_value_heads=4, q_lora_rank=128),
    "llama4_text": dict(hidden_size=256, intermediate_size=128, intermediate_size_mlp=256, head_dim=64),
}


@pytest.fixture(scope="session")
def block_friendly(tiny_checkpoint):
    """block_friendly(model_type) -> folder of a tiny checkpoint whose experts fit 128x128 blocks."""
    return lambda model_type: tiny_checkpoint(model_type, max_shard_size="1MB", initializer_range=0.0625,
                                              **BLOCK_FRIENDLY[model_type])
