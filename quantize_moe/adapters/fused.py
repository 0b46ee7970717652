"""Fused on-disk expert tensors: one tensor holds a projection of every expert of a layer.

A `FusedLayout` says how such a tensor maps onto the stacked view the rest of the
tool uses (per shard w1/w3/w2, `[E, out, in]`), and back. The layouts in the wild:

| family    | tensor                      | on disk                 | per expert            |
|-----------|-----------------------------|-------------------------|-----------------------|
| GraniteMoE| `input_linear.weight`       | `[E, 2I, H]`            | gate rows, then up    |
| DBRX      | `mlp.w1` / `mlp.v1`, `mlp.w2` | `[E*I, H]`            | w1/v1 `[out, in]`, w2 `[in, out]` |
| gpt-oss   | `experts.gate_up_proj`      | `[E, H, 2I]`            | `[in, out]`, gate/up interleaved |
| Llama-4   | `experts.gate_up_proj`      | `[E, H, 2I]`            | `[in, out]`, gate half then up |

A layout with `unfused` names is written back one Linear per expert and projection
(`experts.{e}.gate_proj.weight`, ...) instead: the only FP8 layout its engine reads
with a scale for every expert (vLLM's Llama-4 loader puts a flat fused scale into
expert 0 alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FusedLayout:
    name: str  # regex of the tensor name relative to one decoder layer
    shards: tuple[str, ...]  # shard ids along each expert's output rows, in order: ("w1", "w3") or ("w2",)
    scale_group: str  # tensors of one layer with the same group share one scale per expert (gate with up)
    transposed: bool = False  # each expert is stored `[in, out]`
    interleaved: bool = False  # the shards alternate row by row instead of being consecutive blocks
    flat: bool = False  # experts are concatenated along dim 0 (`[E * rows, cols]`), not stacked
    bias: bool = False  # an `[E, out]` bias `{name}_bias` sits beside the tensor (gpt-oss)
    unfused: tuple[str, ...] = ()  # per-expert projection names, one per shard, to write experts under

    def expert_weights(self, tensor_name: str, num_experts: int, shape: tuple[int, ...]) -> list[tuple[str, tuple]]:
        """(name, `[out, in]` shape) of every per-expert Linear an `unfused` layout writes for the tensor
        `tensor_name` of on-disk `shape`, expert by expert, in shard order."""
        experts = tensor_name.rpartition(".")[0]
        shards = self.split(torch.empty(shape, device="meta"), num_experts)
        return [(f"{experts}.{e}.{proj}.weight", tuple(shards[shard].shape[1:]))
                for e in range(num_experts) for shard, proj in zip(self.shards, self.unfused)]

    def disk_shape(self, num_experts: int, hidden: int, width: int) -> tuple[int, ...]:
        """The on-disk shape for E experts of expert width I and hidden size H."""
        out = width * len(self.shards) if self.shards != ("w2",) else hidden
        inp = hidden if self.shards != ("w2",) else width
        rows, cols = (inp, out) if self.transposed else (out, inp)
        return (num_experts * rows, cols) if self.flat else (num_experts, rows, cols)

    def scale_shape(self, num_experts: int) -> tuple[int, ...]:
        """One per-tensor scale per expert and shard: `[E]`, or `[E, 2]` for gate/up in one tensor."""
        return (num_experts, len(self.shards)) if len(self.shards) > 1 else (num_experts,)

    def split(self, tensor: torch.Tensor, num_experts: int) -> dict[str, torch.Tensor]:
        """Shard id -> `[E, out, in]` view of that shard for every expert."""
        stacked = tensor.reshape(num_experts, -1, tensor.shape[-1]) if self.flat else tensor
        if self.transposed:
            stacked = stacked.transpose(1, 2)
        return dict(zip(self.shards, self._split_rows(stacked, dim=1)))

    def split_bias(self, bias: torch.Tensor) -> dict[str, torch.Tensor]:
        """Shard id -> `[E, out]` part of a fused `[E, out]` bias."""
        return dict(zip(self.shards, self._split_rows(bias, dim=1)))

    def join(self, shards: dict[str, torch.Tensor], disk_shape: tuple[int, ...]) -> torch.Tensor:
        """Inverse of `split`: the on-disk tensor from `[E, out, in]` shards."""
        parts = [shards[s] for s in self.shards]
        stacked = torch.stack(parts, dim=2).flatten(1, 2) if self.interleaved else torch.cat(parts, dim=1)
        if self.transposed:
            stacked = stacked.transpose(1, 2)
        return stacked.reshape(disk_shape).contiguous()

    def per_expert(self, tensor: torch.Tensor, num_experts: int) -> torch.Tensor:
        """`[E, everything of that expert]`: experts lead in every layout."""
        return tensor.reshape(num_experts, -1)

    def _split_rows(self, tensor: torch.Tensor, dim: int) -> list[torch.Tensor]:
        n = len(self.shards)
        if self.interleaved:
            return [tensor.unflatten(dim, (-1, n)).select(dim + 1, i) for i in range(n)]
        return list(tensor.chunk(n, dim=dim))


def scale_name(tensor_name: str, suffix: str) -> str:
    """Where the scale of a fused tensor lives: `x.weight` -> `x.weight_scale`, DBRX `mlp.w1` ->
    `mlp.w1_weight_scale` (the names vLLM's loaders for these families look up)."""
    module, _, param = tensor_name.rpartition(".")
    if param == "weight":
        return f"{module}.{suffix}"
    return f"{tensor_name}_{suffix}"
