"""Dequantize an FP8 checkpoint back to bf16 (or another float dtype).

Reads whatever scale layout the checkpoint's quantization_config declares, so it
serves our own output (to load it into plain transformers models for accuracy
checks) and pre-quantized releases alike.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantize_moe.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint
from quantize_moe.formats import read_quantization
from quantize_moe.fp8 import FP8_DTYPE
from quantize_moe.moe.quant_spec import expand_weight_scale
from quantize_moe.output import (check_destination, copy_extra_files, extra_files, prepare_destination, write_json,
                                 write_shard)

SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")


def _is_scale(name: str) -> bool:
    return name.rpartition(".")[2] in SCALE_SUFFIXES


def dequantize_checkpoint(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16, *,
                          overwrite: bool = False) -> None:
    """Write SRC into DST in `dtype`, shard by shard, without scales or quantization_config."""
    src, dst = Path(src), Path(dst)
    checkpoint = Checkpoint(src)
    spec, scale_suffix = read_quantization(checkpoint.raw_config, f"'{src / CONFIG_NAME}'")
    extras = extra_files(checkpoint)
    check_destination(src, dst, overwrite=overwrite, resume=False)
    prepare_destination(dst, overwrite=overwrite)
    weight_map, total = {}, 0
    for file in checkpoint.shard_files:
        tensors = {}
        for name, info in checkpoint.tensors.items():
            if info.file != file or _is_scale(name):
                continue
            tensor = checkpoint.get(name)
            if tensor.dtype == FP8_DTYPE:
                scale = checkpoint.get(f"{name.removesuffix('.weight')}.{scale_suffix}").float()
                scale = expand_weight_scale(scale.reshape(1, *scale.shape) if scale.dim() else scale.reshape(1),
                                            spec, (1, *tensor.shape))[0]
                tensor = (tensor.float() * scale).to(dtype)
            tensors[name] = tensor
            total += tensor.nbytes
        write_shard(dst / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))
    copy_extra_files(checkpoint, dst, extras)
    if (src / INDEX_NAME).exists():
        write_json(dst / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    config = {k: v for k, v in checkpoint.raw_config.items() if k != "quantization_config"}
    write_json(dst / CONFIG_NAME, config)
    checkpoint.close()
