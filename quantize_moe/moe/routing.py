"""Router top-k selection of the MoE families we support, in torch.

Each rule reproduces its family's Hugging Face transformers router bit for bit
on float32 logits (tests compare against transformers' own modules and MoE
blocks), and returns float32 weights and int32 expert ids, the inputs of
`fused_experts`.

| scoring         | families                                    | weights                                       |
|-----------------|---------------------------------------------|-----------------------------------------------|
| softmax_topk    | Mixtral, Qwen2/3-MoE, Qwen3-Next, OLMoE,    | softmax over all experts, top-k, renormalize? |
|                 | Jamba, Hunyuan; DBRX (p-norm); ERNIE-4.5    | ERNIE: chosen by probability + correction     |
|                 |                                             | bias, sum clamped to `moe_norm_min`           |
| grouped_softmax | DeepSeek-V2                                 | softmax; groups ranked by their best expert   |
| grouped_sigmoid | DeepSeek-V3, Kimi-K2, GLM-4.5; MiniMax-M2   | sigmoid; bias-corrected grouped choice        |
|                 | (one group)                                 |                                               |
| topk_softmax    | GraniteMoE (Shared, Hybrid), gpt-oss        | top-k of the (biased) logits, their softmax   |
| topk_sigmoid    | Llama-4                                     | sigmoid of the chosen logit, on the input     |
| sparsemixer     | Phi-3.5-MoE                                 | best expert, then best of the rest; each a    |
|                 |                                             | softmax over the experts within a relative    |
|                 |                                             | margin of that round's winner                 |

Llama-4 multiplies the router weight into the expert *input*, not its
output; with a SiLU MLP that is a different function, so `expert_inputs`
scales the rows and hands `fused_experts` unit weights (one expert per token).
"""

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

Scoring = Literal["softmax_topk", "grouped_softmax", "grouped_sigmoid", "topk_softmax", "topk_sigmoid",
                  "sparsemixer"]


@dataclass(frozen=True)
class RoutingRule:
    scoring: Scoring
    top_k: int
    # softmax_topk, grouped_sigmoid: divide the chosen weights by their sum
    # (Mixtral always; Qwen `norm_topk_prob`; DeepSeek-V3 `norm_topk_prob`).
    renormalize: bool = False
    # softmax_topk: renormalize by this p-norm instead (DBRX `moe_normalize_expert_weights`), and by no
    # less than `norm_min` (ERNIE `moe_norm_min`).
    norm_p: float = 1.0
    norm_min: float = 0.0
    # grouped_sigmoid: experts form n_group equal groups, ranked by the sum of
    # their two best biased scores; experts of the best topk_group groups compete.
    # grouped_softmax (DeepSeek-V2 group_limited_greedy): groups ranked by their best score.
    n_group: int = 1
    topk_group: int = 1
    # grouped_sigmoid, grouped_softmax: multiplies the chosen weights.
    routed_scaling_factor: float = 1.0
    # grouped_sigmoid, softmax_topk: added to the sigmoid scores (softmax probabilities) for choosing
    # experts only; the weights stay unbiased.
    e_score_correction_bias: torch.Tensor | None = field(default=None, compare=False)
    # topk_softmax: the router's linear bias, if the logits do not include it yet.
    logit_bias: torch.Tensor | None = field(default=None, compare=False)
    # sparsemixer: an expert competes when (best - its logit) / max(|its logit|, best) <= 2 * jitter_eps.
    jitter_eps: float = 0.0
    # topk_sigmoid (Llama-4): the weight scales the expert's input rather than its output.
    scales_input: bool = False

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError("top_k must be positive")
        if self.scoring.startswith("grouped") and not 1 <= self.topk_group <= self.n_group:
            raise ValueError("need 1 <= topk_group <= n_group")
        if self.scoring == "sparsemixer" and self.top_k != 2:
            raise ValueError("sparsemixer picks exactly two experts")
        if self.scales_input and self.top_k != 1:
            raise ValueError("a router weight on the expert input needs one expert per token")


def select_experts(router_logits: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick top-k experts per token: (topk_weights float32 [T, k], topk_ids int32 [T, k])."""
    logits = router_logits.reshape(-1, router_logits.shape[-1])
    if rule.scoring == "softmax_topk":
        weights, ids = _softmax_topk(logits, rule)
    elif rule.scoring == "grouped_softmax":
        weights, ids = _grouped_softmax(logits, rule)
    elif rule.scoring == "grouped_sigmoid":
        weights, ids = _grouped_sigmoid(logits, rule)
    elif rule.scoring == "topk_softmax":
        weights, ids = _topk_softmax(logits, rule)
    elif rule.scoring == "topk_sigmoid":
        chosen, ids = torch.topk(logits, rule.top_k, dim=-1)
        weights = torch.sigmoid(chosen.float())
    elif rule.scoring == "sparsemixer":
        weights, ids = _sparsemixer(logits, rule)
    else:
        raise ValueError(f"unknown scoring {rule.scoring!r}")
    return weights.float(), ids.to(torch.int32)


def route(hidden_states: torch.Tensor, router: dict[str, torch.Tensor],
          rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route [T, H] hidden states with a router's parameters (`weight`, float32 logits): the
    (rows, topk_weights, topk_ids) to hand `fused_experts`."""
    logits = F.linear(hidden_states.float(), router["weight"].float())
    weights, ids = select_experts(logits, rule)
    return (*expert_inputs(hidden_states, weights, rule), ids)


def expert_inputs(hidden_states: torch.Tensor, weights: torch.Tensor,
                  rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows and weights `fused_experts` needs: as they are, or, for a rule whose weight scales the
    expert input (Llama-4, one expert per token), the scaled rows and unit weights."""
    if not rule.scales_input:
        return hidden_states, weights
    return (hidden_states.float() * weights).to(hidden_states.dtype), torch.ones_like(weights)


def _softmax_topk(logits: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if rule.e_score_correction_bias is None:
        weights, ids = torch.topk(probs, rule.top_k, dim=-1)
    else:
        ids = torch.topk(probs + rule.e_score_correction_bias, rule.top_k, dim=-1).indices
        weights = probs.gather(1, ids)
    if rule.renormalize:
        norm = weights.sum(dim=-1, keepdim=True) if rule.norm_p == 1 else torch.norm(
            weights, p=rule.norm_p, dim=-1, keepdim=True)
        weights = weights / norm.clamp_min(rule.norm_min)
    return weights, ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, experts_per_group: int) -> torch.Tensor:
    """[T, E] mask of the experts in each token's best `topk_group` groups."""
    best_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    return group_mask.repeat_interleave(experts_per_group, dim=1)


def _grouped_softmax(logits: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if rule.n_group > 1:
        group_scores = scores.view(num_tokens, rule.n_group, -1).amax(dim=-1)
        scores = scores.masked_fill(~_group_mask(group_scores, rule.topk_group, num_experts // rule.n_group), 0.0)
    weights, ids = torch.topk(scores, rule.top_k, dim=-1, sorted=False)
    return weights * rule.routed_scaling_factor, ids


def _grouped_sigmoid(logits: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    scores = logits.float().sigmoid()
    for_choice = scores if rule.e_score_correction_bias is None else scores + rule.e_score_correction_bias
    grouped = for_choice.view(num_tokens, rule.n_group, num_experts // rule.n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    expert_mask = _group_mask(group_scores, rule.topk_group, num_experts // rule.n_group)
    ids = for_choice.masked_fill(~expert_mask, float("-inf")).topk(rule.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * rule.routed_scaling_factor, ids


def _topk_softmax(logits: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    if rule.logit_bias is not None:
        logits = logits + rule.logit_bias
    chosen, ids = torch.topk(logits, rule.top_k, dim=-1)
    return torch.softmax(chosen, dim=-1, dtype=chosen.dtype), ids


def _sparsemixer(logits: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE at inference: the best expert, then the best of the rest; each weighted by a softmax
    over the experts whose logits lie within a relative margin of that round's winner."""
    weights, ids = [], []
    scores = logits = logits.float()
    for _ in range(2):
        best, best_id = scores.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * rule.jitter_eps
        weights.append(torch.softmax(scores.masked_fill(far, float("-inf")), dim=-1).gather(1, best_id))
        ids.append(best_id)
        scores = scores.scatter(1, best_id, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)
