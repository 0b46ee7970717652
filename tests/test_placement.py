"""A fused parameter filled in place is what transformers' own conversion operations make of its sources."""

import pytest
import torch
from transformers.core_model_loading import (Chunk, Concatenate, MergeModulelist, Transpose, WeightConverter,
                                             dot_natural_key)

from quantize_moe.run.placement import FusedPlacement

GATE_UP = [".experts.*.w1.weight", ".experts.*.w3.weight"]
EXPERTS = 12  # past 10: the loader stacks experts in natural order (2 before 10), not as strings sort


def _sources(patterns: list[str], shape: tuple[int, ...]) -> dict[str, tuple[str, torch.Tensor]]:
    """Checkpoint name -> (the source pattern it matches, its tensor), for every expert of every pattern,
    in the order of the names as strings (expert 10 before expert 2)."""
    generator = torch.Generator().manual_seed(0)
    sources = {f"model.layers.0{p.replace('*', str(e))}": (p, torch.randn(shape, generator=generator))
               for p in patterns for e in range(EXPERTS)}
    return dict(sorted(sources.items()))


def _converted(converter: WeightConverter, sources: dict[str, tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The parameter transformers' operations make, each pattern's tensors in the loader's (natural) order."""
    collected = {p: [sources[name][1] for name in sorted(sources, key=dot_natural_key) if sources[name][0] == p]
                 for p in converter.source_patterns}
    for op in converter.operations:
        collected = op.convert(collected, source_patterns=converter.source_patterns,
                               target_patterns=converter.target_patterns)
    return next(iter(collected.values()))


@pytest.mark.parametrize("patterns, operations", [
    (GATE_UP, [MergeModulelist(dim=0), Concatenate(dim=1)]),  # Mixtral's, Qwen3-MoE's gate_up_proj
    ([".experts.*.w2.weight"], [MergeModulelist(dim=0)]),  # their down_proj
    (GATE_UP, [MergeModulelist(dim=0), Concatenate(dim=0)]),
    (GATE_UP, [MergeModulelist(dim=0), Concatenate(dim=-1)]),
])
def test_placement_fills_what_the_operations_make(patterns, operations):
    converter = WeightConverter(patterns, ".experts.fused", operations)
    sources = _sources(patterns, (6, 4))
    want = _converted(converter, sources)
    placement = FusedPlacement.of(converter, {name: p for name, (p, _) in sources.items()},
                                  {name: t.shape for name, (_, t) in sources.items()}, want.to("meta"))
    assert placement is not None
    got = placement.fill(lambda name, out: out.copy_(sources[name][1]), threads=3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("patterns, operations, shape", [
    (GATE_UP, [MergeModulelist(dim=1), Concatenate(dim=1)], (6, 4)),  # stacked along another dim
    (GATE_UP, [MergeModulelist(dim=0), Concatenate(dim=1), Transpose(1, 2)], (6, 4)),  # a further operation
    ([".experts.*.w2.weight"], [MergeModulelist(dim=0), Chunk(dim=1)], (6, 4)),
    (GATE_UP, [MergeModulelist(dim=0)], (6, 4)),  # two sources, no concatenation
    (GATE_UP, [MergeModulelist(dim=0), Concatenate(dim=1)], (5, 4)),  # not the parameter's shape
])
def test_anything_else_is_left_to_transformers_loader(patterns, operations, shape):
    converter = WeightConverter(patterns, ".experts.fused", operations)
    sources = _sources(patterns, shape)
    meta = torch.empty(EXPERTS, 12, 4, device="meta")
    assert FusedPlacement.of(converter, {name: p for name, (p, _) in sources.items()},
                             {name: t.shape for name, (_, t) in sources.items()}, meta) is None
