"""`quantize-moe dequantize`: an FP8 checkpoint written back in bf16, shard by shard, without scales
or `quantization_config` (the way to requantize a checkpoint that is already FP8)."""

from __future__ import annotations

from pathlib import Path

import torch

from quantize_moe.adapters.reader import SourceReader
from quantize_moe.errors import UserError
from quantize_moe.source.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint
from quantize_moe.write.destination import (check_destination, copy_extra_files, extra_files, prepare_destination,
                                            write_json, write_shard)


def dequantize_checkpoint(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16, *,
                          overwrite: bool = False) -> None:
    """Write SRC into DST in `dtype`, shard by shard, without scales or quantization_config."""
    src, dst = Path(src), Path(dst)
    reader = SourceReader(Checkpoint(src), dtype)
    checkpoint = reader.checkpoint
    if not reader.quantized:
        raise UserError(f"'{src / CONFIG_NAME}' has no quantization_config: SRC is not quantized, so there "
                        "is nothing to dequantize.")
    extras = extra_files(checkpoint)
    check_destination(src, dst, overwrite=overwrite, resume=False)
    prepare_destination(dst, overwrite=overwrite)
    weight_map, total = {}, 0
    names = set(reader.names)
    for file in checkpoint.shard_files:
        tensors = {name: reader.get(name) for name, info in checkpoint.tensors.items()
                   if info.file == file and name in names}
        total += sum(t.nbytes for t in tensors.values())
        write_shard(dst / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))
    copy_extra_files(checkpoint, dst, extras)
    if (src / INDEX_NAME).exists():
        write_json(dst / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    config = {k: v for k, v in checkpoint.raw_config.items() if k != "quantization_config"}
    write_json(dst / CONFIG_NAME, config)
    reader.close()
