"""Load the routed experts of one MoE layer of a checkpoint into a `FusedMoE`.

The original and the quantized checkpoint go through the same path: the adapter
says which tensor is which expert's w1/w2/w3, the checkpoint's quantization_config
picks the method object, and the layer's weight loader does the rest.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from transformers import PretrainedConfig

from quantize_moe.adapters import Kind, MoELayerInfo, PerExpertFamily, adapter_for, parse_config
from quantize_moe.adapters.fused import FusedLayout, scale_name
from quantize_moe.adapters.reader import check_weights_match_config
from quantize_moe.source.checkpoint import READ_THREADS, Checkpoint
from quantize_moe.source.locations import CONFIG_NAME
from quantize_moe.errors import UserError
from quantize_moe.quantization.formats import INPUT_SCALE, read_quantization
from quantize_moe.moe.layer import FusedMoE
from quantize_moe.moe.methods import method_for_spec
from quantize_moe.quantization.spec import MoEQuantSpec

EXPERT_CHUNK_BYTES = 256 << 20  # bf16 weights of the experts a check holds at once


@dataclass
class MoECheckpoint:
    """A checkpoint opened for layer-by-layer loading of its routed experts."""

    checkpoint: Checkpoint
    family: PerExpertFamily
    config: PretrainedConfig
    spec: MoEQuantSpec
    scale_suffix: str | None
    layers: dict[int, MoELayerInfo]
    experts: dict[int, list[tuple[str, int, str]]] = field(default_factory=dict)  # layer -> (module, e, shard)
    fused: dict[int, list[tuple[str, FusedLayout]]] = field(default_factory=dict)  # layer -> (name, layout)

    @classmethod
    def open(cls, folder: str | Path, adapter: str | None = None) -> "MoECheckpoint":
        checkpoint = Checkpoint(folder)
        where = f"'{checkpoint.folder / CONFIG_NAME}'"
        family = adapter_for(checkpoint.raw_config, where, checkpoint.tensors, adapter)
        config = parse_config(checkpoint.raw_config, family, where, checkpoint.tensors)
        spec, scale_suffix = read_quantization(checkpoint.raw_config, where)
        check_weights_match_config(checkpoint, scale_suffix is not None, where)
        experts: dict[int, list] = defaultdict(list)
        fused: dict[int, list] = defaultdict(list)
        for name, info in checkpoint.tensors.items():
            role = family.role(name, len(info.shape))
            if role.kind == Kind.ROUTED_EXPERT and role.fused is not None:
                fused[role.layer].append((name, role.fused))
            elif role.kind == Kind.ROUTED_EXPERT:
                experts[role.layer].append((role.module, role.expert, role.shard_id))
        layers = {info.layer: info for info in family.moe_layers(config)}
        return cls(checkpoint, family, config, spec, scale_suffix, layers, dict(experts), dict(fused))

    def load_layer(self, layer: int, device: str | torch.device = "cpu",
                   params_dtype: torch.dtype = torch.bfloat16) -> FusedMoE:
        return self.load_experts(layer, range(self.layers[layer].num_experts), device, params_dtype)

    def expert_chunks(self, layer: int, budget_bytes: int | None = None) -> list[range]:
        """The layer's experts in consecutive ranges of about `budget_bytes` of bf16 weights (at least
        one expert each): what the checks load at once, so their memory does not grow with the layer."""
        info = self.layers[layer]
        per_chunk = max(1, (budget_bytes or EXPERT_CHUNK_BYTES) // (3 * info.hidden_size * info.expert_width * 2))
        return [range(start, min(start + per_chunk, info.num_experts))
                for start in range(0, info.num_experts, per_chunk)]

    def load_experts(self, layer: int, experts: range, device: str | torch.device = "cpu",
                     params_dtype: torch.dtype = torch.bfloat16) -> FusedMoE:
        """A `FusedMoE` of the layer's experts in `experts` only (renumbered from 0), its parameters made
        on `device` and filled there one checkpoint tensor at a time (no host copy of the layer); static
        input scales are reduced over these experts, so only a whole layer carries the scales an engine
        would use."""
        info = self.layers[layer]
        with torch.device(device):
            moe = FusedMoE(len(experts), info.hidden_size, info.expert_width, method_for_spec(self.spec),
                           params_dtype, name=f"'{self.checkpoint.folder}' layer {layer}")
        params = dict(moe.named_parameters())
        in_place = []  # (checkpoint tensor, the part of a parameter it fills), read in parallel below
        for module, expert, shard_id in self.experts.get(layer, []):
            if expert not in experts:
                continue
            prefix, local = "w2" if shard_id == "w2" else "w13", expert - experts.start
            weight, param = f"{module}.weight", f"{prefix}_weight"
            target = moe.shard_target(params[param], param, shard_id, local)
            if self.checkpoint.readable_into(weight, target):
                in_place.append((weight, target))
                moe.mark_loaded(param, shard_id, local)
            else:  # another dtype (converted by the loader) or a pickle shard
                moe.weight_loader(params[param], self.checkpoint.get(weight), param, shard_id, local)
            for suffix, param in self._scale_params(prefix):
                moe.weight_loader(params[param], self._scale(f"{module}.{suffix}"), param, shard_id, local)
        with ThreadPoolExecutor(READ_THREADS) as pool:  # pread releases the GIL: the disk sees many reads
            list(pool.map(lambda job: self.checkpoint.read_into(*job), in_place))
        for name, layout in self.fused.get(layer, []):
            self._load_fused(moe, params, name, layout, info.num_experts, experts)
        moe.process_weights_after_loading()
        return moe.to(device)

    def _load_fused(self, moe: FusedMoE, params: dict, name: str, layout: FusedLayout, num_experts: int,
                    experts: range) -> None:
        """Slice a tensor holding every expert into per-expert w1/w3/w2 and load those in `experts`, like
        the engines' `load_weights` for these families; scales `[E]` or `[E, shards]` go per expert and shard."""
        prefix = "w2" if layout.shards == ("w2",) else "w13"
        shards = layout.split(self.checkpoint.get(name), num_experts)
        scales = {param: self._scale(scale_name(name, suffix)).reshape(num_experts, -1)
                  for suffix, param in self._scale_params(prefix)}
        for index, (shard_id, weights) in enumerate(shards.items()):
            for local, expert in enumerate(experts):
                moe.weight_loader(params[f"{prefix}_weight"], weights[expert], f"{prefix}_weight", shard_id, local)
                for param, scale in scales.items():
                    moe.weight_loader(params[param], scale[expert, index % scale.shape[1]], param, shard_id, local)

    def _scale_params(self, prefix: str) -> list[tuple[str, str]]:
        """(checkpoint suffix, layer parameter) of the scales an expert projection carries: its weight
        scale, and the static input scale when the config declares static activations."""
        if self.scale_suffix is None:
            return []
        pairs = [(self.scale_suffix, f"{prefix}_weight_scale")]
        return pairs + [(INPUT_SCALE, f"{prefix}_input_scale")] if self.spec.static else pairs

    def _scale(self, name: str) -> torch.Tensor:
        if name not in self.checkpoint.tensors:
            raise UserError(f"'{self.checkpoint.folder}' has no tensor '{name}', which its quantization_config "
                            "needs; re-download or requantize the checkpoint.")
        return self.checkpoint.get(name).float()

    def load_router(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's router parameters in float32 by parameter name: `weight`, and `bias` or
        `e_score_correction_bias` where the family has one (the inputs of `family.routing_rule`)."""
        router = {}
        for name, info in self.checkpoint.tensors.items():
            role = self.family.role(name, len(info.shape))
            if role.kind == Kind.ROUTER and role.layer == layer:
                router[name.rpartition(".")[2]] = self.checkpoint.get(name).float()
        if "weight" not in router:
            raise UserError(f"No router weight found for MoE layer {layer} in '{self.checkpoint.folder}'.")
        return router

    def load_biases(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(w13_bias [E, 2I] gate then up, w2_bias [E, H]) of a family with expert biases (gpt-oss)."""
        biases = {}
        for name, layout in self.fused.get(layer, []):
            if not layout.bias:
                return None
            biases.update(layout.split_bias(self.checkpoint.get(f"{name}_bias").float()))
        if not biases:
            return None
        return torch.cat([biases["w1"], biases["w3"]], dim=1), biases["w2"]
