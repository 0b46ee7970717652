"""select_experts against the routers of Hugging Face transformers, on CPU."""

import pytest
import torch
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
from transformers.models.llama4.modeling_llama4 import Llama4Router
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from quantize_moe.moe.routing import RoutingRule, select_experts

HIDDEN = 32
TOKENS = 37


def _randomize(router: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for tensor in list(router.parameters()) + list(router.buffers()):
            tensor.normal_()
    return router


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Some routers return their top-k unsorted: compare (id, weight) sets."""
    ids, order = ids.long().sort(dim=-1)
    return weights.gather(1, order), ids


def _assert_same_routing(ours, theirs) -> None:
    our_w, our_ids = _sorted_by_id(*ours)
    their_w, their_ids = _sorted_by_id(*theirs)
    torch.testing.assert_close(our_ids, their_ids, rtol=0, atol=0)
    torch.testing.assert_close(our_w, their_w.float(), rtol=0, atol=0)


def test_mixtral_softmax_renormalized():
    router = _randomize(MixtralTopKRouter(MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)))
    x = torch.randn(TOKENS, HIDDEN)
    logits, weights, ids = router(x)
    ours = select_experts(logits, RoutingRule("softmax_topk", top_k=2, renormalize=True))
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.int32
    _assert_same_routing(ours, (weights, ids))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_softmax(norm_topk_prob):
    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=64, num_experts_per_tok=8, norm_topk_prob=norm_topk_prob)
    router = _randomize(Qwen3MoeTopKRouter(config))
    logits, weights, ids = router(torch.randn(TOKENS, HIDDEN))
    rule = RoutingRule("softmax_topk", top_k=8, renormalize=norm_topk_prob)
    _assert_same_routing(select_experts(logits, rule), (weights, ids))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_grouped_sigmoid(norm_topk_prob):
    config = DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=3,
        routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob,
    )
    router = _randomize(DeepseekV3TopkRouter(config))
    logits, weights, ids = router(torch.randn(TOKENS, HIDDEN))
    rule = RoutingRule(
        "grouped_sigmoid", top_k=6, renormalize=norm_topk_prob, n_group=8, topk_group=3,
        routed_scaling_factor=2.5, e_score_correction_bias=router.e_score_correction_bias,
    )
    _assert_same_routing(select_experts(logits, rule), (weights, ids))


def test_correction_bias_changes_choice_not_weights():
    """The bias moves which experts win, while weights stay the un-biased sigmoid scores."""
    logits = torch.randn(TOKENS, 16)
    bias = torch.zeros(16)
    bias[3] = 100.0
    rule = RoutingRule("grouped_sigmoid", top_k=2, n_group=1, topk_group=1, e_score_correction_bias=bias)
    weights, ids = select_experts(logits, rule)
    assert (ids == 3).any(dim=-1).all()
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, ids.long()))


def test_gpt_oss_topk_then_softmax_with_bias():
    config = GptOssConfig(hidden_size=HIDDEN, num_local_experts=32, num_experts_per_tok=4)
    router = _randomize(GptOssTopKRouter(config))
    x = torch.randn(TOKENS, HIDDEN)
    _, weights, ids = router(x)
    unbiased_logits = x @ router.weight.T
    rule = RoutingRule("topk_softmax", top_k=4, logit_bias=router.bias.detach())
    _assert_same_routing(select_experts(unbiased_logits, rule), (weights, ids))


def test_llama4_top1_sigmoid():
    config = Llama4TextConfig(hidden_size=HIDDEN, num_local_experts=16, num_experts_per_tok=1)
    router = _randomize(Llama4Router(config))
    scores, logits = router(torch.randn(TOKENS, HIDDEN))
    weights, ids = select_experts(logits, RoutingRule("topk_sigmoid", top_k=1))
    # transformers returns a dense [T, E] score matrix, sigmoid(-inf) = 0 off the chosen expert.
    dense = torch.zeros_like(scores).scatter_(1, ids.long(), weights)
    torch.testing.assert_close(dense, scores, rtol=0, atol=0)


def test_rule_validation():
    with pytest.raises(ValueError):
        RoutingRule("grouped_sigmoid", top_k=2, n_group=4, topk_group=5)
    with pytest.raises(ValueError):
        RoutingRule("softmax_topk", top_k=0)


@pytest.mark.parametrize("topk_method,n_group,topk_group", [("greedy", 1, 1), ("group_limited_greedy", 4, 2)])
def test_deepseek_v2_softmax(topk_method, n_group, topk_group):
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3, topk_method=topk_method,
                              n_group=n_group, topk_group=topk_group, routed_scaling_factor=1.7)
    router = _randomize(DeepseekV2TopkRouter(config))
    logits, weights, ids = router(torch.randn(TOKENS, HIDDEN))
    rule = RoutingRule("grouped_softmax", top_k=3, n_group=n_group, topk_group=topk_group, routed_scaling_factor=1.7)
    _assert_same_routing(select_experts(logits, rule), (weights, ids))
