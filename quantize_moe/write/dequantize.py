"""`quantize-moe dequantize`: an FP8 checkpoint written back in bf16, shard by shard, without scales
or `quantization_config` (the way to requantize a checkpoint that is already FP8). Each shard is laid
out first and filled one tensor at a time (`ShardFile`), so memory holds one tensor, not a shard."""

from __future__ import annotations

from pathlib import Path

import torch

from quantize_moe.adapters.reader import SourceReader
from quantize_moe.plan.plan import OutputTensor
from quantize_moe.quantization.fp8 import FP8_DTYPE
from quantize_moe.errors import UserError
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.locations import CONFIG_NAME, INDEX_NAME
from quantize_moe.write.destination import (check_destination, copy_extra_files, extra_files, prepare_destination,
                                            write_json)
from quantize_moe.write.shard_file import ShardFile


def dequantize_checkpoint(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16, *,
                          overwrite: bool = False) -> tuple[int, int, int]:
    """Write SRC into DST in `dtype`, shard by shard, without scales or quantization_config; returns the
    tensors, bytes and shards written."""
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
        outputs = [OutputTensor(name, dtype if info.dtype == FP8_DTYPE else info.dtype, info.shape)
                   for name, info in checkpoint.tensors.items() if info.file == file and name in names]
        if not outputs:  # a shard of scales only: nothing of it is left
            continue
        shard = ShardFile(dst / file, outputs)
        try:
            for output in outputs:
                shard.write(output.name, reader.get(output.name).contiguous())
        except BaseException:
            shard.abort()
            raise
        shard.finish()
        total += sum(output.nbytes for output in outputs)
        weight_map.update(dict.fromkeys((output.name for output in outputs), file))
    copy_extra_files(checkpoint, dst, extras)
    if (src / INDEX_NAME).exists():
        write_json(dst / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    config = {k: v for k, v in checkpoint.raw_config.items() if k != "quantization_config"}
    write_json(dst / CONFIG_NAME, config)
    reader.close()
    return len(weight_map), total, len(set(weight_map.values()))
