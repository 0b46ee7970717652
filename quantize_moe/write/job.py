"""The main job: stream a checkpoint through the plan and write the FP8 checkpoint.

The engine (`quantize_moe.write.pipeline`) holds a few work items (scale groups, e.g.
gate and up of one expert) in memory at a time, never a whole shard, and writes
them in place into their shards. Everything that can be checked without
reading tensor data (SRC, the plan, DST, free space) is checked before the
first byte is written; finished shards are recorded in the manifest so a
killed run continues with `resume`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from quantize_moe.write import pipeline
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.locations import CONFIG_NAME, INDEX_NAME
from quantize_moe.console import byte_progress, console
from quantize_moe.write.manifest import Manifest, run_fingerprint, source_records
from quantize_moe.write.destination import (check_destination, check_free_space, copy_extra_files, extra_files,
                                 prepare_destination, replaced_files, write_json)
from quantize_moe.errors import UsageError
from quantize_moe.plan.calibrated import calibrated_values
from quantize_moe.plan.plan import Plan, make_plan
from quantize_moe.plan.options import Options
from quantize_moe.quantization.static import ActivationAmax

# Generous bound on the bytes one tensor adds to its shard's safetensors header and to the index,
# beyond its name: free space is checked against payload plus this.
_METADATA_BYTES_PER_TENSOR = 256


@dataclass(frozen=True)
class Calibration:
    """How `--activations static` / `--kv-cache fp8` measure their scales: `measure` runs the model over the calibration
    tokens (run/calibration.py, a stage above this one, supplied by the caller) after every pre-flight check
    passed and before anything is written; `digest` names the tokens and options for the run fingerprint."""

    digest: str
    measure: Callable[[Plan], ActivationAmax]


@dataclass(frozen=True)
class RunSummary:
    plan: Plan
    seconds: float
    copied_files: list[str]
    activation_amax: ActivationAmax | None = None


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
                        show_progress: bool = True, device: str = "cpu", workers: int | None = None,
                        calibration: Calibration | None = None) -> RunSummary:
    """SRC is a folder or an opened Checkpoint (e.g. one streamed from the Hub). Quantizes on `device`
    (cpu, cuda, or cuda:0,cuda:1,...) with `workers` items in flight (default: one per core on the
    CPU, a few per GPU). `--activations static` and `--kv-cache fp8` need `calibration`: the model is run
    over its tokens first (streamed, one layer at a time), then the checkpoint is quantized."""
    start = time.perf_counter()
    devices = pipeline.parse_devices(device)
    if workers is not None and workers < 1:
        raise UsageError(f"--workers {workers} must be at least 1.")
    devices_started = pipeline.start_devices(devices)
    checkpoint = src if isinstance(src, Checkpoint) else Checkpoint(src, allow_pickle=allow_pickle)
    src, dst = checkpoint.folder, Path(dst)
    plan = make_plan(checkpoint, options)
    plan.check_loadable()
    plan.check_requantize()
    if plan.options.calibrates != (calibration is not None):
        raise ValueError("quantize_checkpoint takes a Calibration exactly when the options ask for calibrated scales")
    if plan.source.quantized:
        console.print(f"[yellow]warning:[/] '{src}' is already quantized: its weights are dequantized and rounded "
                      "to FP8 again (--requantize), so they carry two roundings; the model card says so.")
    extras = extra_files(checkpoint)
    check_destination(src, dst, overwrite=overwrite, resume=resume)
    manifest = Manifest.for_run(dst, run_fingerprint(plan, calibration and calibration.digest), resume,
                                source_records(checkpoint))
    check_free_space(dst, output_bytes(plan, extras) - manifest.finished_bytes,
                     freed=sum(p.stat().st_size for p in replaced_files(dst, overwrite=overwrite)))
    finished = manifest.matching(plan.shard_names)
    # A resumed run whose calibrated outputs all lie in finished shards need not run the model again.
    amax = calibration.measure(plan) if calibration and any(
        not item.sources for name, items in zip(plan.shard_names, plan.shards) if name not in finished
        for item in items) else None
    if amax is not None:
        plan.calibrated_scales = calibrated_values(plan, amax)
    prepare_destination(dst, overwrite=overwrite)
    manifest.save()

    devices_started.result()
    with byte_progress(show_progress) as progress:
        task = progress.add_task("quantizing", total=sum(i.input_bytes for i in plan.items))
        progress.advance(task, sum(item.input_bytes for name, items in zip(plan.shard_names, plan.shards)
                                   if name in finished for item in items))
        pipeline.run(plan, dst, devices, workers or pipeline.default_workers(devices), skip=finished,
                   on_item_done=lambda item: progress.advance(task, item.input_bytes),
                   on_shard_finished=manifest.record)
    weight_map = {o.name: name for name, items in zip(plan.shard_names, plan.shards)
                  for item in items for o in item.outputs}

    copy_extra_files(checkpoint, dst, extras)
    written = [*extras, CONFIG_NAME]
    if len(plan.shards) > 1:
        write_json(dst / INDEX_NAME, {"metadata": {"total_size": plan.bytes_after}, "weight_map": weight_map})
        written.append(INDEX_NAME)
    write_json(dst / CONFIG_NAME, {**checkpoint.raw_config, "quantization_config": plan.quantization_config})
    manifest.finish(written)
    checkpoint.close()
    return RunSummary(plan, time.perf_counter() - start, extras, amax)


__all__ = ["Calibration", "Options", "RunSummary", "quantize_checkpoint"]
