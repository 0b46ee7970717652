"""What a produced checkpoint holds: every weight's role, whether it is FP8, and its scale.

Read from the output alone (headers and config), so the model card and `verify`
describe what is on disk, not what the run meant to write.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from transformers import PretrainedConfig

from quantize_moe.adapters import PerExpertFamily, TensorRole, adapter_for, parse_config
from quantize_moe.source.checkpoint import Checkpoint, TensorInfo
from quantize_moe.source.locations import CONFIG_NAME
from quantize_moe.adapters.fused import scale_name
from quantize_moe.adapters.reader import SCALE_SUFFIXES
from quantize_moe.quantization.formats import read_quantization, reads_kv_cache
from quantize_moe.quantization.fp8 import FP8_DTYPE
from quantize_moe.quantization.spec import MoEQuantSpec
from quantize_moe.quantization.static import KV_SCALES


@dataclass(frozen=True)
class StoredTensor:
    info: TensorInfo
    role: TensorRole

    @property
    def quantized(self) -> bool:
        return self.info.dtype == FP8_DTYPE


@dataclass
class Inventory:
    checkpoint: Checkpoint
    family: PerExpertFamily
    config: PretrainedConfig
    spec: MoEQuantSpec
    scale_suffix: str | None  # None when the config declares no quantization
    tensors: dict[str, StoredTensor]  # everything but scales
    scales: dict[str, TensorInfo]  # weight and input scales, and the KV cache's k_scale / v_scale
    num_experts: dict[int, int]  # MoE layer -> routed experts
    adapter: str | None = None  # the explicit --adapter it was read with, for reading the source the same way
    kv_cache: bool = False  # the config declares an FP8 KV cache

    @cached_property
    def attention(self) -> list[str]:
        """The attention modules (those with a k_proj Linear): where an FP8 KV cache has its scales."""
        return [n.removesuffix(".k_proj.weight") for n, s in self.tensors.items()
                if n.endswith(".k_proj.weight") and s.role.is_linear_weight]

    def scale_of(self, name: str) -> TensorInfo | None:
        return self.scales.get(scale_name(name, self.scale_suffix))


def take_inventory(checkpoint: Checkpoint, adapter: str | None = None) -> Inventory:
    where = f"'{checkpoint.folder / CONFIG_NAME}'"
    family = adapter_for(checkpoint.raw_config, where, checkpoint.tensors, adapter)
    config = parse_config(checkpoint.raw_config, family, where, checkpoint.tensors)
    spec, scale_suffix = read_quantization(checkpoint.raw_config, where)
    tensors, scales = {}, {}
    for name, info in checkpoint.tensors.items():
        if name.endswith(SCALE_SUFFIXES + KV_SCALES):
            scales[name] = info
        else:
            tensors[name] = StoredTensor(info, family.role(name, len(info.shape)))
    num_experts = {info.layer: info.num_experts for info in family.moe_layers(config)}
    return Inventory(checkpoint, family, config, spec, scale_suffix, tensors, scales, num_experts, adapter,
                     reads_kv_cache(checkpoint.raw_config, where))
