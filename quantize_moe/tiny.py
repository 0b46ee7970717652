"""Tiny checkpoints of real MoE families, built by transformers itself.

Used by `quantize-moe demo` and the tests: `save_pretrained` writes each family's
real Hub tensor names, so what works here works on a downloaded checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

_ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=128, tie_word_embeddings=False,
                  initializer_range=0.125)  # unit-variance pre-activations at hidden 64, as in real models

TINY_CONFIGS: dict[str, dict] = {
    "mixtral": dict(_ATTENTION, intermediate_size=96, num_hidden_layers=2, num_local_experts=4,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(_ATTENTION, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_hidden_layers=3, num_experts=4,
                      num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe": dict(_ATTENTION, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16),
    "deepseek_v3": dict(_ATTENTION, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                        topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5),
    "deepseek_v2": dict(_ATTENTION, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, topk_method="greedy"),
}


def build_tiny_checkpoint(model_type: str, folder: str | Path, *, seed: int = 0,
                          max_shard_size: str = "100KB", dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save a randomly initialised tiny model of `model_type` to `folder`, in several shards."""
    folder = Path(folder)
    transformers_logging.disable_progress_bar()
    config = CONFIG_MAPPING[model_type](**TINY_CONFIGS[model_type])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder
