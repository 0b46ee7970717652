"""The MoE families quantize-moe knows, each a declaration.

Where a family's experts (per expert, or fused), routers and shared experts live,
what else stays in high precision, and which config keys say how many experts
there are and which layers are MoE. Layout facts: ../shared/reference/moe-families.md.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import PretrainedConfig

from quantize_moe.adapters.base import PerExpertFamily, config_int, config_ints, text_config
from quantize_moe.adapters.fused import FusedLayout
from quantize_moe.errors import UserError
from quantize_moe.moe.routing import RoutingRule

MIXTRAL_PROJECTIONS = {"w1": "w1", "w3": "w3", "w2": "w2"}
LLAMA_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
EXPERTS_GATE_UP_DOWN = r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
EXPERTS_W1_W3_W2 = r"block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<proj>w1|w3|w2)"
MAMBA = ((r"mamba\..*", "Mamba mixer: state-space parameters stay bf16"),)
LINEAR_ATTENTION = ((r"linear_attn\..*", "linear attention: stays bf16"),)


class QwenMoEFamily(PerExpertFamily):
    """Qwen2/3-MoE: `mlp_only_layers` stay dense; others are MoE every `decoder_sparse_step`."""

    def is_moe_layer(self, config: PretrainedConfig, layer: int) -> bool:
        dense = config_ints(config, "mlp_only_layers")
        step = config_int(config, "decoder_sparse_step", 1) or 1
        return layer not in dense and (layer + 1) % step == 0


class DeepseekFamily(PerExpertFamily):
    """DeepSeek-V2/V3, Kimi-K2, GLM-4.5: the first `first_k_dense_replace` layers are dense MLPs."""

    def is_moe_layer(self, config: PretrainedConfig, layer: int) -> bool:
        first_dense = config_int(config, "first_k_dense_replace", 0)
        freq = config_int(config, "moe_layer_freq", 1) or 1
        return layer >= first_dense and layer % freq == 0

    def routing_rule(self, config: PretrainedConfig, router: dict[str, torch.Tensor], layer: int = 0) -> RoutingRule:
        """V3/Kimi-K2/GLM-4.5 (`noaux_tc`): biased sigmoid with grouped choice; V2: softmax, greedy or group-limited."""
        common = dict(top_k=config_int(config, "num_experts_per_tok"), n_group=config_int(config, "n_group", 1) or 1,
                      topk_group=config_int(config, "topk_group", 1) or 1,
                      routed_scaling_factor=getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        if getattr(config, "topk_method", "noaux_tc") == "noaux_tc":
            return RoutingRule("grouped_sigmoid", renormalize=bool(getattr(config, "norm_topk_prob", True)),
                               e_score_correction_bias=router.get("e_score_correction_bias"), **common)
        if config.topk_method == "greedy":
            common.update(n_group=1, topk_group=1)
        return RoutingRule("grouped_softmax", **common)


class ErnieFamily(PerExpertFamily):
    """ERNIE-4.5: MoE from `moe_layer_start_index` to `moe_layer_end_index`, every `moe_layer_interval`."""

    def is_moe_layer(self, config: PretrainedConfig, layer: int) -> bool:
        end = config.moe_layer_end_index
        end = config.num_hidden_layers - 1 if end is None or end < 0 else end
        return config.moe_layer_start_index <= layer <= end and (layer + 1) % config.moe_layer_interval == 0

    def routing_rule(self, config: PretrainedConfig, router: dict[str, torch.Tensor], layer: int = 0) -> RoutingRule:
        """Softmax; experts chosen by probability plus `moe_statics.e_score_correction_bias`, weights
        renormalized by a sum of at least `moe_norm_min`."""
        return replace(super().routing_rule(config, router, layer), norm_min=config.moe_norm_min or 0.0)


class PhimoeFamily(PerExpertFamily):
    """Phi-3.5-MoE: sparsemixer routing, which picks two experts whatever `num_experts_per_tok` says."""

    def routing_rule(self, config: PretrainedConfig, router: dict[str, torch.Tensor], layer: int = 0) -> RoutingRule:
        return RoutingRule("sparsemixer", top_k=2, jitter_eps=config.router_jitter_noise)


class DbrxFamily(PerExpertFamily):
    """DBRX: softmax top-k, renormalized by the `ffn_config.moe_normalize_expert_weights`-norm (if set)."""

    def routing_rule(self, config: PretrainedConfig, router: dict[str, torch.Tensor], layer: int = 0) -> RoutingRule:
        norm_p = config.ffn_config.moe_normalize_expert_weights
        return RoutingRule("softmax_topk", top_k=config.ffn_config.moe_top_k, renormalize=norm_p is not None,
                           norm_p=norm_p or 1.0)


class JambaFamily(PerExpertFamily):
    """Jamba: MoE every `expert_layer_period` layers from `expert_layer_offset`."""

    def is_moe_layer(self, config: PretrainedConfig, layer: int) -> bool:
        return config.layers_num_experts[layer] > 1


class Llama4Family(PerExpertFamily):
    """Llama-4: the text config's `moe_layers` (from `interleave_moe_layer_step`)."""

    def is_moe_layer(self, config: PretrainedConfig, layer: int) -> bool:
        return layer in config.moe_layers

    def routing_rule(self, config: PretrainedConfig, router: dict[str, torch.Tensor], layer: int = 0) -> RoutingRule:
        """Sigmoid of the chosen logit, which scales the expert's input: the fused experts run that by
        scaling the rows, which is the same function only with one expert per token."""
        top_k = self.config_value(text_config(config), self.top_k_keys, layer)
        if top_k != 1:
            raise UserError(f"This Llama-4 config has num_experts_per_tok {top_k}, but its router weight scales "
                            "the expert input, which quantize-moe can only run with one expert per token.")
        return RoutingRule("topk_sigmoid", top_k=1, scales_input=True)


MIXTRAL = PerExpertFamily(
    name="Mixtral",
    model_types=("mixtral",),
    experts=EXPERTS_W1_W3_W2,
    projections=MIXTRAL_PROJECTIONS,
    routers=(r"block_sparse_moe\.gate",),
)

PHIMOE = PhimoeFamily(
    name="Phi-3.5-MoE",
    model_types=("phimoe",),
    experts=EXPERTS_W1_W3_W2,
    projections=MIXTRAL_PROJECTIONS,
    routers=(r"block_sparse_moe\.gate",),
)

MINIMAX_M2 = PerExpertFamily(
    name="MiniMax-M2",
    model_types=("minimax_m2",),
    experts=EXPERTS_W1_W3_W2,
    projections=MIXTRAL_PROJECTIONS,
    routers=(r"block_sparse_moe\.gate", r"block_sparse_moe"),  # the block holds e_score_correction_bias
    scoring="grouped_sigmoid",  # in one group: sigmoid, bias-corrected choice, renormalized
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

QWEN3_NEXT = QwenMoEFamily(
    name="Qwen3-Next",
    model_types=("qwen3_next",),
    experts=EXPERTS_GATE_UP_DOWN,
    projections=LLAMA_PROJECTIONS,
    routers=(r"mlp\.gate",),
    shared_experts=(r"mlp\.shared_expert",),
    keep_linears=((r"mlp\.shared_expert_gate", "shared_expert_gate: a 1-row gate on the shared expert"),
                  *LINEAR_ATTENTION),
    num_experts_keys=("num_experts",),
    renormalize="norm_topk_prob",
    zero_centered_norm=True,
)

GLM4_MOE = DeepseekFamily(
    name="GLM-4.5/4.6",
    model_types=("glm4_moe",),
    experts=EXPERTS_GATE_UP_DOWN,
    projections=LLAMA_PROJECTIONS,
    routers=(r"mlp\.gate",),
    shared_experts=(r"mlp\.shared_experts",),
    num_experts_keys=("n_routed_experts",),
)

OLMOE = PerExpertFamily(
    name="OLMoE",
    model_types=("olmoe",),
    experts=EXPERTS_GATE_UP_DOWN,
    projections=LLAMA_PROJECTIONS,
    routers=(r"mlp\.gate",),
    num_experts_keys=("num_experts",),
    renormalize="norm_topk_prob",
)

ERNIE4_5_MOE = ErnieFamily(
    name="ERNIE-4.5-MoE",
    model_types=("ernie4_5_moe",),
    experts=EXPERTS_GATE_UP_DOWN,
    projections=LLAMA_PROJECTIONS,
    routers=(r"mlp\.gate", r"mlp\.moe_statics"),
    shared_experts=(r"mlp\.shared_experts",),
    num_experts_keys=("moe_num_experts",),
    top_k_keys=("moe_k",),
)

HUNYUAN_MOE = PerExpertFamily(
    name="Hunyuan-MoE",
    model_types=("hunyuan_v1_moe",),
    experts=EXPERTS_GATE_UP_DOWN,
    projections=LLAMA_PROJECTIONS,
    routers=(r"mlp\.gate\.wg",),
    shared_experts=(r"mlp\.shared_mlp",),
    num_experts_keys=("num_experts",),
    top_k_keys=("moe_topk",),
)

JAMBA = JambaFamily(
    name="Jamba",
    model_types=("jamba",),
    experts=r"feed_forward\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)",
    projections=LLAMA_PROJECTIONS,
    routers=(r"feed_forward\.router",),
    keep_linears=MAMBA,
    num_experts_keys=("num_experts",),
    renormalize=False,
    moe_input_norm=r"pre_ff_layernorm",
)

# vLLM's GraniteMoe(Shared|Hybrid) loaders split `input_linear.weight_scale` like the weight:
# `p[e].chunk(2)`, so the gate/up scale of expert e is a row of two.
_GRANITE_EXPERTS = (
    FusedLayout(r"block_sparse_moe\.input_linear\.weight", ("w1", "w3"), "w13"),
    FusedLayout(r"block_sparse_moe\.output_linear\.weight", ("w2",), "w2"),
)

GRANITE_MOE = PerExpertFamily(
    name="GraniteMoE",
    model_types=("granitemoe", "granitemoeshared", "granitemoehybrid"),
    fused=_GRANITE_EXPERTS,
    routers=(r"block_sparse_moe\.router\.layer",),
    scoring="topk_softmax",
    shared_experts=(r"shared_mlp",),
    keep_linears=MAMBA,
    fp8_loads_in="vLLM (GraniteMoeShared/Hybrid loaders route input_linear/output_linear weight_scale)",
)

DBRX = DbrxFamily(
    name="DBRX",
    model_types=("dbrx",),
    fused=(
        FusedLayout(r"ffn\.experts\.mlp\.w1", ("w1",), "w13", flat=True),
        FusedLayout(r"ffn\.experts\.mlp\.v1", ("w3",), "w13", flat=True),
        FusedLayout(r"ffn\.experts\.mlp\.w2", ("w2",), "w2", flat=True, transposed=True),
    ),
    routers=(r"ffn\.router\.layer",),
    layers=r"transformer\.blocks",
    moe_input_norm=r"norm_attn_norm\.norm_2",
    num_experts_keys=("ffn_config.moe_num_experts",),
    expert_width_keys=("ffn_config.ffn_hidden_size",),
    top_k_keys=("ffn_config.moe_top_k",),
    fp8_loads_in="vLLM (DbrxExperts.weight_loader reads mlp.{w1,v1,w2}_weight_scale)",
)

GPT_OSS = PerExpertFamily(
    name="gpt-oss",
    model_types=("gpt_oss",),
    fused=(
        FusedLayout(r"mlp\.experts\.gate_up_proj", ("w1", "w3"), "w13", transposed=True, interleaved=True,
                    bias=True),
        FusedLayout(r"mlp\.experts\.down_proj", ("w2",), "w2", transposed=True,
                    bias=True),
    ),
    routers=(r"mlp\.router",),
    scoring="topk_softmax",  # of the logits plus the router's bias
    activation="swigluoai",
    fp8_loads_in="",
    fp8_refusal="vLLM 0.32's gpt-oss loader (GptOssModel._load_weights_other, its path for fp8 and "
                "compressed-tensors) copies gate_up_proj/down_proj into w13/w2 with no path for their weight "
                "scales, SGLang's (GptOssForCausalLM._load_normal_weights) maps only the fused weights and "
                "biases, and transformers has no FP8 path for its fused experts, so an FP8 gpt-oss checkpoint "
                "loads nowhere")

# Written per expert: vLLM's Llama-4 loader (Llama4Model.load_moe_expert_weights) reads
# `experts.{e}.gate_proj/up_proj/down_proj` with a scale each, the layout of Meta's FP8 release, but
# loads a flat fused-expert weight_scale into expert 0 only.
LLAMA4 = Llama4Family(
    name="Llama-4",
    model_types=("llama4", "llama4_text"),
    experts=r"feed_forward\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)",
    projections=LLAMA_PROJECTIONS,
    fused=(
        FusedLayout(r"feed_forward\.experts\.gate_up_proj", ("w1", "w3"), "w13", transposed=True,
                    unfused=("gate_proj", "up_proj")),
        FusedLayout(r"feed_forward\.experts\.down_proj", ("w2",), "w2", transposed=True, unfused=("down_proj",)),
    ),
    routers=(r"feed_forward\.router",),
    shared_experts=(r"feed_forward\.shared_expert",),
    keep_modules=((r"(vision_model|multi_modal_projector)\.", "vision tower: stays bf16"),),
    # vLLM permutes q/k rows and any q/k `weight_scale` of more than one element for its rotary
    # embedding (Llama4ForCausalLM.permute_qk_weight_for_rotary), which 128x128 block scales cannot follow.
    keep_linears_in=tuple(("compressed-tensors", "block", rf"self_attn\.{p}", "vLLM permutes Llama-4's q/k rows "
                           "for its rotary embedding, which block scales named weight_scale cannot follow")
                          for p in ("q_proj", "k_proj")),
    layers=r"(?:language_model\.)?model\.layers",
)

FAMILIES: tuple[PerExpertFamily, ...] = (
    MIXTRAL, QWEN2_MOE, QWEN3_MOE, QWEN3_NEXT, DEEPSEEK, GLM4_MOE, OLMOE, PHIMOE, ERNIE4_5_MOE, HUNYUAN_MOE,
    MINIMAX_M2, JAMBA, GRANITE_MOE, DBRX, GPT_OSS, LLAMA4,
)
