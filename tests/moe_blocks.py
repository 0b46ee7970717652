"""What a transformers MoE block hands its experts, and routing comparisons, shared by the family tests."""

from __future__ import annotations

import torch


def expert_call(model: torch.nn.Module, layer: int, hidden_states: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """Run decoder layer `layer`'s MoE block on `hidden_states` [1, T, H]: the (args, output) of its one
    experts call, i.e. the block's own routing decisions and the experts' result."""
    blocks = [m for name, m in model.named_modules()
              if name.split(".")[-2:-1] == [str(layer)] and hasattr(m, "experts")]
    assert len(blocks) == 1, f"no single MoE block in layer {layer}"
    calls = []
    hook = blocks[0].experts.register_forward_hook(lambda m, args, out: calls.append((args, out)))
    with torch.no_grad():
        blocks[0](hidden_states)
    hook.remove()
    (call,) = calls
    return call


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Some routers return their top-k unsorted: compare (id, weight) sets."""
    ids, order = ids.long().sort(dim=-1)
    return weights.gather(1, order), ids


def assert_same_routing(ours, theirs) -> None:
    """(weights, ids) pairs choose the same experts with bit-identical weights."""
    our_w, our_ids = _sorted_by_id(*ours)
    their_w, their_ids = _sorted_by_id(*theirs)
    torch.testing.assert_close(our_ids, their_ids, rtol=0, atol=0)
    torch.testing.assert_close(our_w, their_w.float(), rtol=0, atol=0)
