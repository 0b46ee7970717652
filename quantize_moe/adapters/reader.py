"""Any supported checkpoint read in high precision, the family's fused layouts and scales included.

`SourceReader` is the one place FP8 weights become floats again: per-tensor,
per-channel and 128x128-block scales (DeepSeek-V3, Kimi-K2 and Qwen FP8 releases
ship `weight_scale_inv` blocks), and the per-expert scales of fused expert
tensors. `quantize` reads a pre-quantized SRC through it (dequantize, then
requantize into the requested scheme); `write.dequantize` writes what it reads.
"""

from __future__ import annotations

import torch

from quantize_moe.adapters import Kind, PerExpertFamily, adapter_for, parse_config
from quantize_moe.adapters.fused import FusedLayout, scale_name
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.locations import CONFIG_NAME
from quantize_moe.errors import UserError
from quantize_moe.quantization.formats import read_quantization
from quantize_moe.quantization.fp8 import FP8_DTYPE, dequantize_grid, grid_shape
from quantize_moe.quantization.spec import scale_count, weight_cell

SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")


def check_weights_match_config(checkpoint: Checkpoint, quantized: bool, where: str) -> None:
    """FP8 tensors without a quantization_config, a quantization_config over weights none of which is
    FP8, or a scale beside a weight that is not FP8, mean the config and the tensors come from different
    saves: reading on would drop the scales (or apply them to weights they do not belong to)."""
    tensors = checkpoint.tensors
    if not quantized:
        fp8 = next((info for info in tensors.values() if info.dtype == FP8_DTYPE), None)
        if fp8 is not None:
            raise UserError(f"Tensor '{fp8.name}' is {fp8.dtype} but {where} has no quantization_config, so "
                            "its scale is unknown; restore the config.json of the quantized checkpoint, or point "
                            "SRC at an unquantized one.")
        return
    method = checkpoint.raw_config["quantization_config"].get("quant_method")
    if not any(info.dtype == FP8_DTYPE for info in tensors.values()):
        raise UserError(f"{where} has a quantization_config ({method}) but no tensor of the checkpoint is FP8; "
                        "the config and the weights come from different saves: remove quantization_config "
                        "for a bf16 checkpoint, or restore the FP8 weights.")
    for name in (n for n in tensors if n.endswith(SCALE_SUFFIXES)):
        stem = name[:-len(next(s for s in SCALE_SUFFIXES if name.endswith(s)))]
        owner = stem[:-1] + ".weight" if stem.endswith(".") else stem[:-1]
        if owner in tensors and tensors[owner].dtype != FP8_DTYPE:
            raise UserError(f"Tensor '{owner}' is {tensors[owner].dtype} but has the FP8 scale '{name}'; the "
                            "checkpoint mixes quantized and unquantized saves, so restore a consistent one.")


class SourceReader:
    """The tensors of a checkpoint, FP8 weights dequantized to `dtype` (float32 when they are to be
    requantized, so no bf16 rounding sits between the two); scale tensors are metadata of the
    source's quantization, not tensors of the model, and are left out of `names`."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype = torch.bfloat16, adapter: str | None = None):
        where = f"'{checkpoint.folder / CONFIG_NAME}'"
        self.checkpoint, self.dtype = checkpoint, dtype
        self.spec, self.scale_suffix = read_quantization(checkpoint.raw_config, where)
        self.family: PerExpertFamily = adapter_for(checkpoint.raw_config, where, checkpoint.tensors, adapter)
        self.config = parse_config(checkpoint.raw_config, self.family, where, checkpoint.tensors)
        self._layers = {info.layer: info for info in self.family.moe_layers(self.config)}
        self._experts = {layer: info.num_experts for layer, info in self._layers.items()}
        check_weights_match_config(checkpoint, self.quantized, where)
        self._written_per_expert = self._fused_written_per_expert()

    @property
    def quantized(self) -> bool:
        return self.scale_suffix is not None

    def is_scale(self, name: str) -> bool:
        return self.quantized and name.endswith(SCALE_SUFFIXES)

    @property
    def names(self) -> list[str]:
        return [name for name in self.checkpoint.tensors if not self.is_scale(name)]

    @property
    def model_names(self) -> list[str]:
        """`names` as the family's model holds them: the per-expert tensors written from a fused layout
        (Llama-4's FP8 output, `FusedLayout.unfused`) give way to the fused tensor they were written from,
        which `get` joins back."""
        per_expert = {name for names in self._written_per_expert.values() for name in names}
        return [name for name in self.names if name not in per_expert] + list(self._written_per_expert)

    def _fused_written_per_expert(self) -> dict[str, list[str]]:
        """Fused tensor name -> the per-expert tensors (expert by expert, in shard order) it was written as,
        for the fused layouts this checkpoint holds one Linear per expert and projection of."""
        found = {}
        for layout in (layout for layout in self.family.fused if layout.unfused):
            last = layout.name.rpartition(r"\.")[2]  # the fused tensor's own name: `gate_up_proj`
            for name, info in self.checkpoint.tensors.items():
                role = self.family.role(name, len(info.shape))
                experts = role.module.rpartition(".")[0].rpartition(".")[0]  # `...experts` of `...experts.{e}.proj`
                fused = f"{experts}.{last}"
                if (role.kind != Kind.ROUTED_EXPERT or role.expert != 0 or role.fused is not None
                        or role.module.rpartition(".")[2] != layout.unfused[0]
                        or self.family.role(fused, 3).fused != layout or role.layer not in self._layers):
                    continue
                wanted = [n for n, _ in layout.expert_weights(fused, self._experts[role.layer], self._disk_shape(
                    layout, role.layer))]
                if all(n in self.checkpoint.tensors for n in wanted):
                    found[fused] = wanted
        return found

    def _disk_shape(self, layout: FusedLayout, layer: int) -> tuple[int, ...]:
        info = self._layers[layer]
        return layout.disk_shape(info.num_experts, info.hidden_size, info.expert_width)

    def _joined(self, name: str) -> torch.Tensor:
        """The fused tensor `name` from the per-expert tensors it was written as, each read as `get` reads."""
        role = self.family.role(name, 3)
        layout, per_expert = role.fused, self._written_per_expert[name]
        shards = {shard: torch.stack([self.get(n) for n in per_expert[index::len(layout.shards)]])
                  for index, shard in enumerate(layout.shards)}
        return layout.join(shards, self._disk_shape(layout, role.layer))

    def output_dtype(self, name: str) -> torch.dtype:
        """FP8 weights that are not requantized are written in bf16."""
        dtype = self.checkpoint.tensors[name].dtype
        return torch.bfloat16 if dtype == FP8_DTYPE and self.quantized else dtype

    def get(self, name: str) -> torch.Tensor:
        if name in self._written_per_expert:
            return self._joined(name)
        tensor = self.checkpoint.get(name)
        if self.scaled_alone(name):
            scale, cell = self.scale_grid(name)
            return dequantize_grid(tensor, scale, cell, torch.empty(tensor.shape, dtype=self.dtype))
        if tensor.dtype != FP8_DTYPE or not self.quantized:
            return tensor
        role = self.family.role(name, tensor.dim())  # a tensor of fused experts, a scale per expert
        return self._fused(name, tensor, role.fused, self._experts[role.layer]).to(self.dtype)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """`out.copy_(self.get(name))`, with no tensor of the weight's size beside `out` where the data allows
        (`out` may be a view into a larger tensor, such as one expert's slice of a fused parameter): a
        safetensors tensor of out's dtype read straight into it, an FP8 weight with a scale of its own
        dequantized into it (the same bytes as `get`, with its FP8 bytes only beside it)."""
        info = self.checkpoint.tensors.get(name)
        if info is None or not out.is_contiguous():  # a joined fused tensor (`model_names`)
            out.copy_(self.get(name))
        elif self.scaled_alone(name) and out.dtype == self.dtype:
            scale, cell = self.scale_grid(name)
            dequantize_grid(self.checkpoint.get(name), scale, cell, out)
        elif info.dtype != FP8_DTYPE and self.checkpoint.readable_into(name, out):
            self.checkpoint.read_into(name, out)
        else:
            out.copy_(self.get(name))

    def scaled_alone(self, name: str) -> bool:
        """Whether `name` is an FP8 weight with a scale of its own (no tensor of fused experts): what
        `scale_grid` describes."""
        info = self.checkpoint.tensors[name]
        if info.dtype != FP8_DTYPE or not self.quantized:
            return False
        role = self.family.role(name, len(info.shape))
        return role.kind != Kind.ROUTED_EXPERT or role.fused is None

    def scale_grid(self, name: str) -> tuple[torch.Tensor, tuple[int, int]]:
        """The float32 scales of the FP8 weight `name` (`scaled_alone`) laid out as `fp8.grid_shape`
        says, and the cell of the weight each covers."""
        shape = self.checkpoint.tensors[name].shape
        cell = weight_cell(self.spec, shape)
        return self.stored_scale(name).reshape(grid_shape(shape, cell)), cell

    def stored_scale(self, name: str) -> torch.Tensor:
        """The float32 scale of the (unfused) FP8 weight `name` as stored: scalar, per row or block grid."""
        count = scale_count(self.spec, self.checkpoint.tensors[name].shape)
        return self._scale(name, f"{name.removesuffix('.weight')}.{self.scale_suffix}", count)

    def _fused(self, name: str, q: torch.Tensor, layout: FusedLayout, num_experts: int) -> torch.Tensor:
        """Per-tensor scales `[E]` or `[E, shards]` of a tensor holding every expert."""
        scales = self._scale(name, scale_name(name, self.scale_suffix))
        if scales.numel() not in (num_experts, num_experts * len(layout.shards)):
            raise UserError(f"Scale '{scale_name(name, self.scale_suffix)}' of '{name}' has {scales.numel()} values, "
                            f"but {num_experts} experts need one each (or one per projection); the checkpoint "
                            "is damaged.")
        scales = scales.reshape(num_experts, -1)
        shards = {shard: w.float() * scales[:, i % scales.shape[1], None, None]
                  for i, (shard, w) in enumerate(layout.split(q, num_experts).items())}
        return layout.join(shards, q.shape)

    def _scale(self, name: str, scale: str, numel: int | None = None) -> torch.Tensor:
        """The float32 scale tensor `scale` of FP8 weight `name`: present, of `numel` values when given
        (else the caller's shape check), finite and positive: a NaN, zero or negative multiplier would
        write NaN, zeroed or sign-flipped weights without a word."""
        if scale not in self.checkpoint.tensors:
            raise UserError(f"Tensor '{name}' is FP8 but its scale '{scale}' is missing from "
                            f"'{self.checkpoint.folder}'; re-download the checkpoint.")
        values = self.checkpoint.get(scale).float()
        if numel is not None and values.numel() != numel:
            raise UserError(f"Scale '{scale}' of '{name}' has shape {tuple(values.shape)}, but the weight's "
                            f"{self.spec.weight} scales need {numel} values; the checkpoint is damaged.")
        if not bool(torch.isfinite(values).all() and (values > 0).all()):
            raise UserError(f"Scale '{scale}' of '{name}' holds NaN, Inf, zero or negative values, which would "
                            "destroy the weight; re-download the checkpoint.")
        return values

    def close(self) -> None:
        self.checkpoint.close()
