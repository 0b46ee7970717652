"""The MoE families whose experts are stored as one Linear per expert and projection.

Each family is a declaration: where its experts, routers and shared experts live,
and which config keys say how many experts there are and which layers are MoE.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from quantize_moe.adapters.base import PerExpertFamily
from quantize_moe.moe.routing import RoutingRule

MIXTRAL_PROJECTIONS = {"w1": "w1", "w3": "w3", "w2": "w2"}
LLAMA_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
EXPERTS_GATE_UP_DOWN = r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"


class QwenMoEFamily(PerExpertFamily):
    """Qwen2/3-MoE: `mlp_only_layers` stay dense; others are MoE every `decoder_sparse_step`."""

    def is_moe_layer(self, config: PretrainedConfig, layer: int) -> bool:
        dense = getattr(config, "mlp_only_layers", None) or []
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return layer not in dense and (layer + 1) % step == 0


class DeepseekFamily(PerExpertFamily):
    """DeepSeek-V2/V3, Kimi-K2: the first `first_k_dense_replace` layers are dense MLPs."""

    def is_moe_layer(self, config: PretrainedConfig, layer: int) -> bool:
        first_dense = getattr(config, "first_k_dense_replace", 0) or 0
        freq = getattr(config, "moe_layer_freq", 1) or 1
        return layer >= first_dense and layer % freq == 0

    def routing_rule(self, config: PretrainedConfig, router: dict[str, torch.Tensor]) -> RoutingRule:
        """V3/Kimi-K2 (`noaux_tc`): biased sigmoid with grouped choice; V2: softmax, greedy or group-limited."""
        common = dict(top_k=config.num_experts_per_tok, n_group=getattr(config, "n_group", 1) or 1,
                      topk_group=getattr(config, "topk_group", 1) or 1,
                      routed_scaling_factor=getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        if getattr(config, "topk_method", "noaux_tc") == "noaux_tc":
            return RoutingRule("grouped_sigmoid", renormalize=bool(getattr(config, "norm_topk_prob", True)),
                               e_score_correction_bias=router.get("e_score_correction_bias"), **common)
        if config.topk_method == "greedy":
            common.update(n_group=1, topk_group=1)
        return RoutingRule("grouped_softmax", **common)


MIXTRAL = PerExpertFamily(
    name="Mixtral",
    model_types=("mixtral",),
    experts=r"block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<proj>w1|w3|w2)",
    projections=MIXTRAL_PROJECTIONS,
    routers=(r"block_sparse_moe\.gate",),
)

QWEN2_MOE = QwenMoEFamily(
    name="Qwen2-MoE",
    model_types=("qwen2_moe",),
    experts=EXPERTS_GATE_UP_DOWN,
    projections=LLAMA_PROJECTIONS,
    routers=(r"mlp\.gate",),
    shared_experts=(r"mlp\.shared_expert",),
    keep_linears=((r"mlp\.shared_expert_gate", "shared_expert_gate: a 1-row gate on the shared expert"),),
    num_experts_keys=("num_experts",),
    renormalize="norm_topk_prob",
)

QWEN3_MOE = QwenMoEFamily(
    name="Qwen3-MoE",
    model_types=("qwen3_moe",),
    experts=EXPERTS_GATE_UP_DOWN,
    projections=LLAMA_PROJECTIONS,
    routers=(r"mlp\.gate",),
    num_experts_keys=("num_experts",),
    renormalize="norm_topk_prob",
)

DEEPSEEK = DeepseekFamily(
    name="DeepSeek-V2/V3",
    model_types=("deepseek_v2", "deepseek_v3", "kimi_k2"),
    experts=EXPERTS_GATE_UP_DOWN,
    projections=LLAMA_PROJECTIONS,
    routers=(r"mlp\.gate",),
    shared_experts=(r"mlp\.shared_experts",),
    config_model_type="deepseek_v3",
    num_experts_keys=("n_routed_experts",),
)

FAMILIES: tuple[PerExpertFamily, ...] = (MIXTRAL, QWEN2_MOE, QWEN3_MOE, DEEPSEEK)
