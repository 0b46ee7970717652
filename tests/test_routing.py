"""Every family's routing rule against transformers, on CPU.

Two proofs per family: `family.routing_rule` fed the parameters of the family's own
transformers router module (randomized, biases included) picks what that module picks,
and, on the family's tiny checkpoint, `route` with the router tensors read from disk
hands the experts exactly what the family's transformers MoE block hands them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

# The rules are proven against transformers 5.24's router modules; older releases lack some of them
# (e.g. 5.17 on the GPU machine has no JambaTopKRouter), and `-m gpu` runs must still collect.
if tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 24):
    pytest.skip("the routing proofs need transformers >= 5.24", allow_module_level=True)

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.models.dbrx.configuration_dbrx import DbrxConfig
from transformers.models.dbrx.modeling_dbrx import DbrxFFN
from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.ernie4_5_moe.configuration_ernie4_5_moe import Ernie4_5_MoeConfig
from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.granitemoe.configuration_granitemoe import GraniteMoeConfig
from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeTopKRouter
from transformers.models.granitemoehybrid.configuration_granitemoehybrid import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridTopKRouter
from transformers.models.granitemoeshared.configuration_granitemoeshared import GraniteMoeSharedConfig
from transformers.models.granitemoeshared.modeling_granitemoeshared import GraniteMoeSharedTopKRouter
from transformers.models.hunyuan_v1_moe.configuration_hunyuan_v1_moe import HunYuanMoEV1Config
from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1Gate
from transformers.models.jamba.configuration_jamba import JambaConfig
from transformers.models.jamba.modeling_jamba import JambaTopKRouter
from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
from transformers.models.llama4.modeling_llama4 import Llama4Router
from transformers.models.minimax_m2.configuration_minimax_m2 import MiniMaxM2Config
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.phimoe.configuration_phimoe import PhimoeConfig
from transformers.models.phimoe.modeling_phimoe import PhimoeTopKRouter
from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

from moe_blocks import assert_same_routing, expert_call
from quantize_moe.adapters import adapter_for
from quantize_moe.adapters.families import FAMILIES
from quantize_moe.errors import UserError
from quantize_moe.check.moe_layers import MoECheckpoint
from quantize_moe.moe.routing import RoutingRule, route, select_experts
from quantize_moe.source.tiny import TINY_CONFIGS

HIDDEN = 32
TOKENS = 37


def _top_k_of(output: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of a router returning (logits, weights, ids)."""
    return output[1], output[2]


def _dense_scores(output: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-4's router returns [T, E] scores, sigmoid(-inf) = 0 off the one chosen expert."""
    weights, ids = output[0].max(dim=-1, keepdim=True)
    return weights, ids


def _minimax(config):
    block = MiniMaxM2SparseMoeBlock(config)
    return block, lambda x: _top_k_of(block.gate(x, block.e_score_correction_bias))


def _dbrx(config):
    ffn = DbrxFFN(config)
    return ffn.router, lambda x: ffn.route_tokens_to_experts(ffn.router(x))


def _module(router_class, read=_top_k_of, **kwargs):
    """A factory of (module holding the router parameters, x -> (weights, ids)) for a plain router."""
    def build(config):
        router = router_class(config, **kwargs).eval()
        return router, lambda x: read(router(x))
    return build


# model_type, config, factory; several configs per family where a config key changes the rule.
ROUTERS = [
    ("mixtral", MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2),
     _module(MixtralTopKRouter)),
    *[("qwen2_moe", Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4, norm_topk_prob=n),
       _module(Qwen2MoeTopKRouter)) for n in (True, False)],
    *[("qwen3_moe", Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=64, num_experts_per_tok=8, norm_topk_prob=n),
       _module(Qwen3MoeTopKRouter)) for n in (True, False)],
    ("qwen3_next", Qwen3NextConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4),
     _module(Qwen3NextTopKRouter)),
    *[("olmoe", OlmoeConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4, norm_topk_prob=n),
       _module(OlmoeTopKRouter)) for n in (True, False)],
    ("jamba", JambaConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=2), _module(JambaTopKRouter)),
    ("hunyuan_v1_moe", HunYuanMoEV1Config(hidden_size=HIDDEN, num_experts=16, moe_topk=[2, 5]),
     _module(HunYuanMoEV1Gate, layer_idx=1)),
    ("ernie4_5_moe", Ernie4_5_MoeConfig(hidden_size=HIDDEN, moe_num_experts=16, moe_k=4),
     _module(Ernie4_5_MoeTopKRouter)),
    ("minimax_m2", MiniMaxM2Config(hidden_size=HIDDEN, intermediate_size=8, num_local_experts=16,
                                   num_experts_per_tok=4), _minimax),
    *[("deepseek_v3", DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=64, num_experts_per_tok=6, n_group=8,
                                       topk_group=3, routed_scaling_factor=2.5, norm_topk_prob=n),
       _module(DeepseekV3TopkRouter)) for n in (True, False)],
    *[("deepseek_v2", DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3,
                                       topk_method=method, n_group=groups, topk_group=2, routed_scaling_factor=1.7),
       _module(DeepseekV2TopkRouter)) for method, groups in (("greedy", 1), ("group_limited_greedy", 4))],
    ("glm4_moe", Glm4MoeConfig(hidden_size=HIDDEN, n_routed_experts=32, num_experts_per_tok=4, n_group=4,
                               topk_group=2, routed_scaling_factor=1.8), _module(Glm4MoeTopkRouter)),
    *[("phimoe", PhimoeConfig(hidden_size=HIDDEN, num_local_experts=16, num_experts_per_tok=2,
                              router_jitter_noise=jitter), _module(PhimoeTopKRouter)) for jitter in (0.01, 0.3)],
    ("granitemoe", GraniteMoeConfig(hidden_size=HIDDEN, num_local_experts=16, num_experts_per_tok=4),
     _module(GraniteMoeTopKRouter)),
    ("granitemoeshared", GraniteMoeSharedConfig(hidden_size=HIDDEN, num_local_experts=16, num_experts_per_tok=4),
     _module(GraniteMoeSharedTopKRouter)),
    ("granitemoehybrid", GraniteMoeHybridConfig(hidden_size=HIDDEN, num_local_experts=16, num_experts_per_tok=4,
                                                            mamba_n_heads=4),
     _module(GraniteMoeHybridTopKRouter)),
    *[("dbrx", DbrxConfig(d_model=HIDDEN, ffn_config=dict(ffn_hidden_size=8, moe_num_experts=16, moe_top_k=4,
                                                          moe_normalize_expert_weights=p)), _dbrx)
      for p in (1.0, 2.0, None)],
    ("gpt_oss", GptOssConfig(hidden_size=HIDDEN, num_local_experts=32, num_experts_per_tok=4),
     _module(GptOssTopKRouter)),
    ("llama4_text", Llama4TextConfig(hidden_size=HIDDEN, num_local_experts=16, num_experts_per_tok=1),
     _module(Llama4Router, read=_dense_scores)),
]


def test_every_family_has_router_cases():
    assert {t for family in FAMILIES for t in family.model_types} - {"kimi_k2", "llama4"} == {r[0] for r in ROUTERS}


@pytest.mark.parametrize("model_type,config,factory", ROUTERS,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(ROUTERS)])
def test_routing_rule_matches_transformers_router(model_type, config, factory):
    torch.manual_seed(0)
    module, theirs = factory(config)
    with torch.no_grad():
        for tensor in module.state_dict().values():
            tensor.normal_()
    # What `MoECheckpoint.load_router` reads from disk: the router's parameters by parameter name.
    router = {name.rpartition(".")[2]: tensor for name, tensor in module.state_dict().items()}
    family = adapter_for({"model_type": model_type})
    rule = family.routing_rule(config, router, layer=1)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        expected = theirs(x)
    assert_same_routing(select_experts(F.linear(x, router["weight"]), rule), expected)


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_route_matches_transformers_moe_block_on_tiny_checkpoint(model_type, tiny_checkpoint):
    """The router tensors on disk, routed as validate routes them, give the experts what the family's
    transformers block gives them."""
    folder = tiny_checkpoint(model_type)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = MoECheckpoint.open(folder)
    torch.manual_seed(2)
    for layer, info in ours.layers.items():
        x = torch.randn(TOKENS, info.hidden_size)
        args, _ = expert_call(model, layer, x[None])
        router = ours.load_router(layer)
        rows, weights, ids = route(x, router, ours.family.routing_rule(ours.config, router, layer))
        if len(args) == 1:  # Llama-4: each expert gets every row, scaled by its weight (0 off the chosen one)
            expected = torch.zeros(info.num_experts, TOKENS, info.hidden_size)
            expected[ids[:, 0].long(), torch.arange(TOKENS)] = rows
            # a float32 ulp or two: transformers' sigmoid-times-rows vectorizes differently on other CPUs
            # (an AMD EPYC without AVX-512 differed by 1.2e-7 on 64 of 9472 elements)
            torch.testing.assert_close(args[0], expected.flatten(0, 1), rtol=1e-6, atol=0)
            assert (weights == 1).all()
        else:
            torch.testing.assert_close(rows, x, rtol=0, atol=0)
            assert_same_routing((weights, ids), (args[2], args[1]))


def test_correction_bias_changes_choice_not_weights():
    """The bias moves which experts win, while weights stay the un-biased sigmoid scores."""
    logits = torch.randn(TOKENS, 16)
    bias = torch.zeros(16)
    bias[3] = 100.0
    rule = RoutingRule("grouped_sigmoid", top_k=2, n_group=1, topk_group=1, e_score_correction_bias=bias)
    weights, ids = select_experts(logits, rule)
    assert (ids == 3).any(dim=-1).all()
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, ids.long()))


def test_llama4_needs_one_expert_per_token():
    family = adapter_for({"model_type": "llama4_text"})
    config = Llama4TextConfig(hidden_size=HIDDEN, num_local_experts=16, num_experts_per_tok=2)
    with pytest.raises(UserError, match="one expert per token"):
        family.routing_rule(config, {"weight": torch.randn(16, HIDDEN)})


def test_rule_validation():
    with pytest.raises(ValueError):
        RoutingRule("grouped_sigmoid", top_k=2, n_group=4, topk_group=5)
    with pytest.raises(ValueError):
        RoutingRule("softmax_topk", top_k=0)
    with pytest.raises(ValueError):
        RoutingRule("sparsemixer", top_k=3)
    with pytest.raises(ValueError):
        RoutingRule("topk_sigmoid", top_k=2, scales_input=True)
