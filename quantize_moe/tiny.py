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
    "qwen3_next": dict(_ATTENTION, intermediate_size=96, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, num_hidden_layers=4, num_experts=4,
                       num_experts_per_tok=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, mlp_only_layers=[2],
                       layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
    "glm4_moe": dict(_ATTENTION, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                     n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                     first_k_dense_replace=1, head_dim=16),
    "olmoe": dict(_ATTENTION, intermediate_size=32, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2),
    "phimoe": dict(_ATTENTION, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                   num_experts_per_tok=2),
    "ernie4_5_moe": dict(_ATTENTION, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                         moe_num_experts=4, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1,
                         moe_layer_end_index=2, moe_layer_interval=1),
    "hunyuan_v1_moe": dict(_ATTENTION, intermediate_size=32, num_hidden_layers=2, num_experts=4, moe_topk=2,
                           head_dim=16),
    "minimax_m2": dict(_ATTENTION, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                       num_experts_per_tok=2, head_dim=16),
    "jamba": dict(_ATTENTION, intermediate_size=32, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                  expert_layer_period=2, expert_layer_offset=1, attn_layer_period=4, attn_layer_offset=2,
                  mamba_dt_rank=8),
    "granitemoe": dict(_ATTENTION, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                       num_experts_per_tok=2),
    "granitemoeshared": dict(_ATTENTION, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                             num_experts_per_tok=2, shared_intermediate_size=48),
    "granitemoehybrid": dict(_ATTENTION, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                             num_experts_per_tok=2, shared_intermediate_size=48, layer_types=["mamba", "attention"],
                             mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16),
    # DBRX needs rope_theta inside attn_config to build and clip_qkv set to run a forward pass.
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, vocab_size=128, max_seq_len=128, tie_word_embeddings=False,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)),
    "gpt_oss": dict(_ATTENTION, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                    num_experts_per_tok=2, head_dim=16, layer_types=["sliding_attention", "full_attention"]),
    "llama4_text": dict(_ATTENTION, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=2,
                        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, head_dim=16),
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
