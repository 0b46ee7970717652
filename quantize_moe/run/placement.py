"""Fused expert parameters filled in place from their per-expert checkpoint tensors.

transformers' loader makes a fused parameter such as Mixtral's `gate_up_proj` [E, 2I, H] from every
expert's w1 and w3 by its `WeightConverter`'s operations: `MergeModulelist(dim=0)` stacks each source
pattern's tensors, then `Concatenate` joins the stacks. While it does, it holds the sources, the stacks and
the concatenation: loading a layer peaked 1.36 layers above the level before it. Where a converter's
operations are exactly those two (the per-expert families' experts), each source's place in the parameter
is known from the converter's own source patterns and the order the loader stacks them in, so the
parameter is allocated once and every source read straight into its slice (`SourceReader.read_into`).
Anything else goes through transformers' loader."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch


class FusedPlacement:
    """Where each checkpoint tensor of one fused parameter lies in it: source `name` is
    `parameter.narrow(dim, start, length).select(0, index)`, as MergeModulelist(dim=0) then
    Concatenate(dim) would place it."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, places: dict[str, tuple[int, int, int, int]]):
        self.shape, self.dtype, self.places = shape, dtype, places

    @classmethod
    def of(cls, converter, patterns: dict[str, str], shapes: dict[str, torch.Size],
           meta: torch.Tensor) -> FusedPlacement | None:
        """The placement of the checkpoint tensors `patterns` (name -> the converter's source pattern it
        matched; their `shapes`) into the meta parameter `meta`, or None where `converter` does anything
        else, or the tensors would not make `meta`'s shape (transformers' loader then reports it)."""
        from transformers.core_model_loading import Concatenate, MergeModulelist, dot_natural_key

        ops = converter.operations
        merges = len(ops) in (1, 2) and type(ops[0]) is MergeModulelist and ops[0].dim == 0
        joined = len(ops) == 2 and type(ops[-1]) is Concatenate
        if not merges or len(converter.target_patterns) != 1 or not (joined or len(converter.source_patterns) == 1):
            return None
        stacked = []  # (names in stacking order, their stack's shape) per pattern, in Concatenate's order
        for pattern in converter.source_patterns:
            names = sorted((name for name, p in patterns.items() if p == pattern), key=dot_natural_key)
            if names:
                if names[0] not in shapes or any(shapes.get(name) != shapes[names[0]] for name in names):
                    return None
                stacked.append((names, [len(names), *shapes[names[0]]]))
        rank, dim = meta.dim(), ops[-1].dim if joined else 0
        if not stacked or not -rank <= dim < rank:
            return None
        dim %= rank
        others = [*meta.shape[:dim], *meta.shape[dim + 1:]]
        if (any(len(stack) != rank or stack[:dim] + stack[dim + 1:] != others for _, stack in stacked)
                or sum(stack[dim] for _, stack in stacked) != meta.shape[dim]):
            return None
        places, start = {}, 0
        for names, stack in stacked:
            places.update((name, (dim, start, stack[dim], index)) for index, name in enumerate(names))
            start += stack[dim]
        return cls(meta.shape, meta.dtype, places)

    def fill(self, read_into: Callable[[str, torch.Tensor], None], threads: int) -> torch.Tensor:
        """The parameter, each source written into its slice by `read_into(name, slice)` on `threads` threads."""
        parameter = torch.empty(self.shape, dtype=self.dtype)

        def place(item):
            name, (dim, start, length, index) = item
            read_into(name, parameter.narrow(dim, start, length).select(0, index))

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(place, self.places.items()))
        return parameter
