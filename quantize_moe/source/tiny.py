"""Tiny checkpoints of real MoE families, built by transformers itself.

Used by `quantize-moe demo` and the tests: `save_pretrained` writes each family's
real Hub tensor names, so what works here works on a downloaded checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from quantize_moe.source.locations import CONFIG_NAME, INDEX_NAME
from quantize_moe.quantization.spec import MoEQuantSpec
from quantize_moe.moe.reference import quantize_weight

_ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=128, tie_word_embeddings=False,
                  initializer_range=0.125)  # unit-variance pre-activations at hidden 64, as in real models

# Multi-head latent attention gives every head its own key and value (real configs say so), and
# transformers' attention repeats keys num_heads // num_key_value_heads times: a smaller value breaks it.
_MLA = dict(_ATTENTION, num_key_value_heads=4)

TINY_CONFIGS: dict[str, dict] = {
    "mixtral": dict(_ATTENTION, intermediate_size=96, num_hidden_layers=2, num_local_experts=4,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(_ATTENTION, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_hidden_layers=3, num_experts=4,
                      num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe": dict(_ATTENTION, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16),
    "deepseek_v3": dict(_MLA, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                        topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5),
    "deepseek_v2": dict(_MLA, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
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
                          max_shard_size: str = "100KB", dtype: torch.dtype = torch.bfloat16,
                          **overrides) -> Path:
    """Save a randomly initialised tiny model of `model_type` to `folder`, in several shards;
    `overrides` replace config values (e.g. widths that are multiples of 128 for block scales)."""
    folder = Path(folder)
    transformers_logging.disable_progress_bar()
    config = CONFIG_MAPPING[model_type](**{**TINY_CONFIGS[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # trained routers' correction biases are not zero; zeros would hide one left out
        for name, tensor in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(std=0.1)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def add_mtp_layer(folder: str | Path) -> Path:
    """Append a multi-token-prediction layer the way real DeepSeek-V3 / GLM checkpoints store it (at
    index `num_hidden_layers`, experts included), which transformers' `save_pretrained` leaves out."""
    folder = Path(folder)
    config = json.loads((folder / CONFIG_NAME).read_text())
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    index = json.loads((folder / INDEX_NAME).read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        for name, tensor in load_file(folder / file).items():
            if name.startswith(f"model.layers.{last}."):
                tensors[name.replace(f".{last}.", f".{mtp}.", 1)] = tensor
    hidden = config["hidden_size"]
    tensors.update({f"model.layers.{mtp}.eh_proj.weight": torch.randn(hidden, 2 * hidden).bfloat16(),
                    f"model.layers.{mtp}.enorm.weight": torch.ones(hidden).bfloat16(),
                    f"model.layers.{mtp}.hnorm.weight": torch.ones(hidden).bfloat16()})
    save_file(tensors, folder / "model-mtp.safetensors", metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, "model-mtp.safetensors"))
    (folder / INDEX_NAME).write_text(json.dumps(index))
    (folder / CONFIG_NAME).write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return folder


def to_block_fp8(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128),
                 quantize: tuple[str, ...] = ("proj", ".w1", ".w2", ".w3")) -> Path:
    """A DeepSeek-V3-style block-FP8 copy of a bf16 checkpoint: the Linears whose names contain one of
    `quantize` become FP8 with `weight_scale_inv` per block (128x128 in the releases; tiny models
    need a block that divides their expert width so gate and up do not share one)."""
    spec = MoEQuantSpec("block", "group", block)
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / INDEX_NAME).read_text())
    for file in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, tensor in load_file(src / file).items():
            if name.endswith(".weight") and tensor.dim() == 2 and any(q in name for q in quantize):
                q, scale = quantize_weight(tensor[None].float(), spec)
                tensors[name], tensors[f"{name.removesuffix('.weight')}.weight_scale_inv"] = q[0], scale[0]
                index["weight_map"][f"{name.removesuffix('.weight')}.weight_scale_inv"] = file
            else:
                tensors[name] = tensor
        save_file(tensors, dst / file, metadata={"format": "pt"})
    (dst / INDEX_NAME).write_text(json.dumps(index))
    config = json.loads((src / CONFIG_NAME).read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / CONFIG_NAME).write_text(json.dumps(config))
    return dst
