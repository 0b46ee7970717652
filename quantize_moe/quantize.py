"""The main job: stream a checkpoint through the plan and write the FP8 checkpoint.

Tensors are memory-mapped from the shards and processed one work item (one
scale group, e.g. gate and up of one expert) at a time; only the output shard
being assembled is held in memory. Everything that can be checked without
reading tensor data (SRC, the plan, DST, free space) is checked before the
first byte is written; finished shards are recorded in the manifest so a
killed run continues with `resume`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quantize_moe import fp8
from quantize_moe.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint
from quantize_moe.console import byte_progress
from quantize_moe.manifest import Manifest, run_fingerprint
from quantize_moe.output import (check_destination, check_free_space, copy_extra_files, extra_files,
                                 prepare_destination, replaced_files, write_json, write_shard)
from quantize_moe.plan import Options, Plan, WorkItem, make_plan

# Generous bound on the bytes one tensor adds to its shard's safetensors header and to the index,
# beyond its name: free space is checked against payload plus this.
_METADATA_BYTES_PER_TENSOR = 256


@dataclass(frozen=True)
class RunSummary:
    plan: Plan
    seconds: float
    copied_files: list[str]


def produce(plan: Plan, item: WorkItem) -> dict[str, torch.Tensor]:
    """The output tensors of one work item, named as `item.outputs` lists them."""
    sources = [(name, plan.source.get(name)) for name in item.sources]
    if not item.quantize:  # FP8 tensors of a pre-quantized SRC that stay high precision become bf16
        for name, tensor in sources:
            if tensor.is_floating_point() and tensor.numel():
                fp8.finite_range(tensor, name)
        return {out.name: tensor.to(out.dtype) for (_, tensor), out in zip(sources, item.outputs)}
    out = {}
    role = plan.decisions[item.sources[0]].role
    if role.fused is None:
        quantized = plan.scheme.quantize_group(sources)
    else:
        quantized = plan.scheme.quantize_experts(sources, plan.moe_layer(role.layer).num_experts)
    for q, weight_out, scale_out in zip(quantized, item.outputs[0::2], item.outputs[1::2]):
        out[weight_out.name] = q.weight
        scale = q.scale.to(scale_out.dtype)
        if role.fused is not None:  # [E] -> [E, shards]: the shards of one expert share its scale
            scale = scale.reshape(-1, *[1] * (len(scale_out.shape) - 1)).expand(scale_out.shape)
        out[scale_out.name] = scale.reshape(scale_out.shape).contiguous()
    return out


def output_bytes(plan: Plan, extras: list[str]) -> int:
    """An upper bound on the bytes the finished DST holds, from the plan alone."""
    outputs = [o for item in plan.items for o in item.outputs]
    metadata = sum(2 * len(o.name) + _METADATA_BYTES_PER_TENSOR for o in outputs)
    config = (plan.checkpoint.folder / CONFIG_NAME).stat().st_size + _METADATA_BYTES_PER_TENSOR * (
        1 + len(plan.ignored_modules))
    copies = sum((plan.checkpoint.folder / e).stat().st_size for e in extras)
    return plan.bytes_after + metadata + config + copies


def quantize_checkpoint(src: str | Path | Checkpoint, dst: str | Path, options: Options = Options(), *,
                        overwrite: bool = False, resume: bool = False, allow_pickle: bool = False,
                        show_progress: bool = True) -> RunSummary:
    """SRC is a folder or an opened Checkpoint (e.g. one streamed from the Hub)."""
    start = time.perf_counter()
    checkpoint = src if isinstance(src, Checkpoint) else Checkpoint(src, allow_pickle=allow_pickle)
    src, dst = checkpoint.folder, Path(dst)
    plan = make_plan(checkpoint, options)
    plan.check_loadable()
    extras = extra_files(checkpoint)
    check_destination(src, dst, overwrite=overwrite, resume=resume)
    manifest = Manifest.for_run(dst, run_fingerprint(plan), resume)
    check_free_space(dst, output_bytes(plan, extras) - manifest.finished_bytes,
                     freed=sum(p.stat().st_size for p in replaced_files(dst, overwrite=overwrite)))
    prepare_destination(dst, overwrite=overwrite)
    manifest.save()

    weight_map = {}
    with byte_progress(show_progress) as progress:
        task = progress.add_task("quantizing", total=sum(i.input_bytes for i in plan.items))
        for shard_name, items in zip(plan.shard_names, plan.shards):
            weight_map.update({o.name: shard_name for item in items for o in item.outputs})
            if manifest.matches(shard_name):
                progress.advance(task, sum(item.input_bytes for item in items))
                continue
            tensors: dict[str, torch.Tensor] = {}
            for item in items:
                tensors.update(produce(plan, item))
                progress.advance(task, item.input_bytes)
            write_shard(dst / shard_name, tensors)
            manifest.record(shard_name)

    copy_extra_files(checkpoint, dst, extras)
    written = [*extras, CONFIG_NAME]
    if len(plan.shards) > 1:
        write_json(dst / INDEX_NAME, {"metadata": {"total_size": plan.bytes_after}, "weight_map": weight_map})
        written.append(INDEX_NAME)
    write_json(dst / CONFIG_NAME, {**checkpoint.raw_config, "quantization_config": plan.quantization_config})
    manifest.finish(written)
    checkpoint.close()
    return RunSummary(plan, time.perf_counter() - start, extras)


__all__ = ["Options", "RunSummary", "produce", "quantize_checkpoint"]
