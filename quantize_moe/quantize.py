"""The main job: stream a checkpoint through the plan and write the FP8 checkpoint.

Tensors are memory-mapped from the shards and processed one work item (one
scale group, e.g. gate and up of one expert) at a time; only the output shard
being assembled is held in memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quantize_moe.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint
from quantize_moe.console import byte_progress
from quantize_moe.output import copy_extra_files, prepare_destination, write_json, write_shard
from quantize_moe.plan import Options, Plan, WorkItem, make_plan


@dataclass(frozen=True)
class RunSummary:
    plan: Plan
    seconds: float
    copied_files: list[str]


def produce(plan: Plan, item: WorkItem) -> dict[str, torch.Tensor]:
    """The output tensors of one work item, named as `item.outputs` lists them."""
    sources = [(name, plan.checkpoint.get(name)) for name in item.sources]
    if not item.quantize:
        return dict(sources)
    out = {}
    quantized = plan.scheme.quantize_group(sources)
    for q, weight_out, scale_out in zip(quantized, item.outputs[0::2], item.outputs[1::2]):
        out[weight_out.name] = q.weight
        out[scale_out.name] = q.scale.to(scale_out.dtype).reshape(scale_out.shape)
    return out


def quantize_checkpoint(src: str | Path, dst: str | Path, options: Options = Options(), *,
                        overwrite: bool = False, show_progress: bool = True) -> RunSummary:
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    checkpoint = Checkpoint(src)
    plan = make_plan(checkpoint, options)
    prepare_destination(src, dst, overwrite)

    weight_map = {}
    with byte_progress(show_progress) as progress:
        task = progress.add_task("quantizing", total=sum(i.input_bytes for i in plan.items))
        for shard_name, items in zip(plan.shard_names, plan.shards):
            tensors: dict[str, torch.Tensor] = {}
            for item in items:
                tensors.update(produce(plan, item))
                progress.advance(task, item.input_bytes)
            write_shard(dst / shard_name, tensors)
            weight_map.update(dict.fromkeys(tensors, shard_name))

    copied = copy_extra_files(checkpoint, dst)
    if len(plan.shards) > 1:
        write_json(dst / INDEX_NAME, {"metadata": {"total_size": plan.bytes_after}, "weight_map": weight_map})
    write_json(dst / CONFIG_NAME, {**checkpoint.raw_config, "quantization_config": plan.quantization_config})
    checkpoint.close()
    return RunSummary(plan, time.perf_counter() - start, copied)


__all__ = ["Options", "RunSummary", "produce", "quantize_checkpoint"]
