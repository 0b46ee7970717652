"""The pipelined engine: work items spread over workers that read, quantize and write at once.

Each worker takes the next work item in plan order, reads its sources with one
`pread` each into a buffer it owns, quantizes them on its device (the scheme
calls `fp8` on the CPU, `cuda` on a GPU) into an output buffer it owns,
and writes the results in place into their output shard (`ShardFile`); the
quantized weights sit in that buffer lined up with their place in the shard,
so they are written direct, around the page cache. While
one worker quantizes, another reads or writes, so disk, memory copies and
arithmetic overlap, and the CPU path uses every core.

Memory is bounded by the work, not the model: a worker's buffers hold the
largest quantized work item (gate and up of one expert, say) and are allocated
once, so no page is faulted in twice; tensors kept unchanged are copied a
bounded chunk at a time through the same input buffer (checked for NaN/Inf on
the way). Peak RSS is workers x the largest group, plus torch and Python.

Each worker hashes what it writes, so a shard's digest for the manifest
(`quantize_moe.write.digests`) is ready the moment its last tensor is written,
without reading the shard back.

Which worker does which item changes nothing on disk: every tensor has its
place in its shard before anything is read, so the output is byte-identical
for any number of workers or devices.

That fast path covers plain safetensors sources. Items it does not cover (a
pre-quantized or pickle SRC, a Hub SRC streamed shard by shard, experts fused
into one tensor per layer) are read through the plan's `SourceReader`, one
reader at a time, and computed by `produce` on the CPU; they are written in
place all the same.
"""

from __future__ import annotations

import math
import os
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch

from quantize_moe.quantization import fp8
from quantize_moe.write.digests import shard_digest
from quantize_moe.errors import UsageError, UserError
from quantize_moe.plan.options import GPU_WORKERS_PER_DEVICE
from quantize_moe.adapters.fused import FusedLayout
from quantize_moe.plan.plan import OutputTensor, Plan, WorkItem
from quantize_moe.source.tensor_bytes import read_into
from quantize_moe.source.locations import data_offsets
from quantize_moe.write.shard_file import DIRECT_ALIGNMENT, ShardFile, copy_scratch_bytes, placed


def parse_devices(spec: str) -> list[torch.device]:
    """`cpu`, `cuda`, `cuda:1` or a comma-separated list of CUDA devices."""
    devices = []
    for part in (p.strip() for p in spec.split(",")):
        try:
            device = torch.device(part)
        except RuntimeError:
            raise UsageError(f"--device '{part}' is not a device; write cpu, cuda, cuda:0 or cuda:0,cuda:1.") \
                from None
        if device.type == "cuda":
            available = torch.cuda.device_count()
            index = 0 if device.index is None else device.index
            if index >= available:
                raise UserError(f"--device {part} is not available: this machine has {available} CUDA "
                                "device(s); choose one of them or cpu.")
            device = torch.device("cuda", index)
        elif device.type != "cpu":
            raise UsageError(f"--device {part} is not supported; use cpu or cuda devices.")
        devices.append(device)
    if len(set(devices)) != len(devices) or (len(devices) > 1 and any(d.type == "cpu" for d in devices)):
        raise UsageError(f"--device '{spec}' must be cpu, or distinct CUDA devices.")
    return devices


def pick_device(spec: str) -> torch.device:
    """The one device of a command's `--device`: `auto` is the GPU when torch sees one, else the CPU;
    anything else as `parse_devices` reads it."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    devices = parse_devices(spec)
    if len(devices) > 1:
        raise UsageError(f"--device '{spec}' names several devices; this command runs on one.")
    return devices[0]


def start_devices(devices: list[torch.device]) -> Future:
    """Create the CUDA contexts of `devices` in a thread, so that this overlaps with making the plan;
    the future's result re-raises a failure. (Only contexts: importing in two threads at once could
    meet the other thread's half-imported modules.)"""
    starter = ThreadPoolExecutor(1, "start-devices")
    started = starter.submit(lambda: [torch.empty(1, device=d) for d in devices if d.type == "cuda"])
    starter.shutdown(wait=False)
    return started


def default_workers(devices: list[torch.device]) -> int:
    if devices[0].type == "cpu":
        return len(os.sched_getaffinity(0))
    return GPU_WORKERS_PER_DEVICE * len(devices)


class Worker:
    """One item at a time on one device, with buffers for the largest item allocated once.

    On the CPU the sources are quantized where they were read; on a GPU they go
    through pinned host buffers and the worker's own stream."""

    def __init__(self, device: torch.device, input_bytes: int, output_bytes: int):
        self.device = device
        on_gpu = device.type == "cuda"
        self.host_inputs = torch.empty(input_bytes, dtype=torch.uint8, pin_memory=on_gpu)
        self.host_outputs = torch.empty(output_bytes, dtype=torch.uint8, pin_memory=on_gpu)
        if on_gpu:
            self.inputs = torch.empty(input_bytes, dtype=torch.uint8, device=device)
            self.outputs = torch.empty(output_bytes, dtype=torch.uint8, device=device)
            self.stream = torch.cuda.Stream(device)
        else:
            self.inputs, self.outputs, self.stream = self.host_inputs, self.host_outputs, None
        self.backend = _cuda_backend() if on_gpu else fp8

    def stream_context(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def upload(self, nbytes: int) -> None:
        if self.stream is not None:
            self.inputs[:nbytes].copy_(self.host_inputs[:nbytes], non_blocking=True)

    def output_views(self, host_views: list[torch.Tensor]) -> list[torch.Tensor]:
        """Where to quantize into: the host views themselves on the CPU, the same shapes on the GPU."""
        if self.stream is None:
            return host_views
        return _views(self.outputs, [(v.dtype, v.shape) for v in host_views])

    def download(self, outputs: list[torch.Tensor], host_views: list[torch.Tensor]) -> None:
        if self.stream is not None:
            for output, host in zip(outputs, host_views):
                host.copy_(output, non_blocking=True)
            self.stream.synchronize()


def _cuda_backend():
    from quantize_moe.quantization import cuda  # imports triton: only where a GPU is used
    return cuda


def _views(buffer: torch.Tensor, specs, file_offsets: list[int] | None = None) -> list[torch.Tensor]:
    """Consecutive typed views of a flat byte buffer, one per (dtype, shape); with `file_offsets`, each
    lined up with where it goes in its file (`placed`, DIRECT_ALIGNMENT bytes to spare per view)."""
    views, offset = [], 0
    for i, (dtype, shape) in enumerate(specs):
        n = dtype.itemsize * math.prod(shape)
        view = buffer[offset:offset + n] if file_offsets is None else placed(buffer, offset, n, file_offsets[i])
        views.append(view.view(dtype).reshape(shape))
        offset = view.storage_offset() - buffer.storage_offset() + n
    return views


class OutputShards:
    """The output shards of a plan: each is created when its first item starts and renamed
    to its final name when its last item is written; `on_finished(name, digest)` is called one
    at a time."""

    def __init__(self, plan: Plan, dst: Path, on_finished: Callable[[str, str], None]):
        self.on_finished = on_finished
        self.names = [dst / name for name in plan.shard_names]
        self.tensors = [[o for item in items for o in item.outputs] for items in plan.shards]
        self.shard_of = {id(item): i for i, items in enumerate(plan.shards) for item in items}
        self.items_left = Counter({i: len(items) for i, items in enumerate(plan.shards)})
        self.open: dict[int, ShardFile] = {}
        self.lock, self.finish_lock = threading.Lock(), threading.Lock()

    def for_item(self, item: WorkItem) -> ShardFile:
        index = self.shard_of[id(item)]
        with self.lock:
            if index not in self.open:
                self.open[index] = ShardFile(self.names[index], self.tensors[index])
            return self.open[index]

    def item_done(self, item: WorkItem) -> None:
        index = self.shard_of[id(item)]
        with self.lock:
            self.items_left[index] -= 1
            complete = self.open.pop(index) if self.items_left[index] == 0 else None
        if complete is not None:  # renamed and recorded while the other workers go on
            complete.finish()
            with self.finish_lock:
                self.on_finished(self.names[index].name,
                                 shard_digest(complete.header_sha256, complete.tensor_sha256s()))

    def abort(self) -> None:
        with self.lock:
            for shard in self.open.values():
                shard.abort()
            self.open.clear()


class Sources:
    """Source tensors: read with pread into the caller's buffers where they lie as stored in a local
    safetensors shard, else through the plan's SourceReader (which is not thread-safe: one at a time)."""

    def __init__(self, plan: Plan):
        self.plan, self.infos = plan, plan.checkpoint.tensors
        self.lock = threading.Lock()
        self.fds: dict[str, int] = {}
        self.offsets: dict[str, int] = {}

    def raw(self, name: str) -> bool:
        """Whether `name`'s bytes on disk are the tensor to quantize or copy."""
        checkpoint = self.plan.checkpoint
        return (checkpoint.shards_stay_local and not self.plan.source.quantized
                and self.infos[name].file.endswith(".safetensors"))

    def fd_and_offset(self, name: str) -> tuple[int, int]:
        file = self.infos[name].file
        with self.lock:
            if file not in self.fds:
                path = self.plan.checkpoint.shard_path(file)
                self.offsets.update(data_offsets(path, {n: i.nbytes for n, i in self.infos.items() if i.file == file}))
                self.fds[file] = os.open(path, os.O_RDONLY)
        return self.fds[file], self.offsets[name]

    def read(self, names: tuple[str, ...]) -> list[tuple[str, torch.Tensor]]:
        with self.lock:
            return [(name, self.plan.source.get(name)) for name in names]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def produce(plan: Plan, item: WorkItem, sources: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The output tensors of one work item, named as `item.outputs` lists them (the general path)."""
    if not item.quantize:  # FP8 tensors of a pre-quantized SRC that stay high precision become bf16
        for name, tensor in sources:
            if tensor.is_floating_point() and tensor.numel():
                fp8.finite_range(tensor, name)
        return {out.name: tensor.to(out.dtype) for (_, tensor), out in zip(sources, item.outputs)}
    out = {}
    role = plan.decisions[item.sources[0]].role
    layout = role.fused
    if layout is None:
        quantized = plan.scheme.quantize_group(sources, item.outputs[1].dtype)
    elif layout.unfused:  # every expert's shards (gate with up) a group of their own, in output order
        (_, tensor), = sources
        quantized = _quantize_unfused(plan, layout, plan.moe_layer(role.layer).num_experts, tensor,
                                      item.outputs[0::2], item.outputs[1].dtype)
    else:
        quantized = plan.scheme.quantize_experts(sources, plan.moe_layer(role.layer).num_experts)
    for q, weight_out, scale_out in zip(quantized, item.outputs[0::2], item.outputs[1::2]):
        out[weight_out.name] = q.weight
        scale = q.scale.to(scale_out.dtype)
        if layout is not None and not layout.unfused:  # [E] -> [E, shards]: an expert's shards share its scale
            scale = scale.reshape(-1, *[1] * (len(scale_out.shape) - 1)).expand(scale_out.shape)
        out[scale_out.name] = scale.reshape(scale_out.shape).contiguous()
    return out


def _quantize_unfused(plan: Plan, layout: FusedLayout, num_experts: int, tensor: torch.Tensor,
                      weight_outs: tuple[OutputTensor, ...], scale_dtype: torch.dtype) -> list:
    """One fused tensor quantized as the per-expert Linears `weight_outs` names, expert by expert."""
    shards = layout.split(tensor, num_experts)
    names = iter(o.name for o in weight_outs)
    return [q for e in range(num_experts)
            for q in plan.scheme.quantize_group([(next(names), shards[s][e]) for s in layout.shards], scale_dtype)]


def process(plan: Plan, item: WorkItem, sources: Sources, worker: Worker, shard: ShardFile) -> None:
    """Read, quantize and write one work item (or copy it unchanged, or write its calibrated scales)."""
    if not item.sources:
        for out in item.outputs:
            shard.write(out.name, plan.calibrated_scales[out.name])
        return
    raw = all(sources.raw(name) for name in item.sources)
    if raw and not item.quantize and all(sources.infos[o.name].dtype == o.dtype for o in item.outputs):
        for out in item.outputs:
            # Kept floating-point tensors are checked for NaN/Inf on the way, as `produce` does.
            check = (lambda chunk, out=out: fp8.finite_range(chunk.view(out.dtype), out.name)) \
                if out.dtype.is_floating_point and out.nbytes else None
            shard.copy_from(out.name, *sources.fd_and_offset(out.name), out.nbytes, worker.host_inputs, check)
        return
    if not (raw and item.quantize and plan.decisions[item.sources[0]].role.fused is None):
        for name, tensor in produce(plan, item, sources.read(item.sources)).items():
            shard.write(name, tensor.contiguous())
        return
    infos = [sources.infos[name] for name in item.sources]
    for host_view, info in zip(_views(worker.host_inputs, [(i.dtype, i.shape) for i in infos]), infos):
        read_into(*sources.fd_and_offset(info.name), host_view)
    weight_outs, scale_outs = item.outputs[0::2], item.outputs[1::2]
    # Quantized weights land in host memory lined up with their place in the shard: written direct.
    host_views = _views(worker.host_outputs, [(o.dtype, o.shape) for o in weight_outs],
                        [shard.offsets[o.name] for o in weight_outs])
    with worker.stream_context():
        worker.upload(sum(i.nbytes for i in infos))
        weights = _views(worker.inputs, [(i.dtype, i.shape) for i in infos])
        outputs = worker.output_views(host_views)
        scales = plan.scheme.quantize_group_into(list(zip(item.sources, weights)), outputs,
                                                 backend=worker.backend, scale_dtype=scale_outs[0].dtype)
        scales = [s.reshape(o.shape).to("cpu", o.dtype, non_blocking=True) for s, o in zip(scales, scale_outs)]
        worker.download(outputs, host_views)
    for q, scale, weight_out, scale_out in zip(host_views, scales, weight_outs, scale_outs):
        shard.write(weight_out.name, q)
        shard.write(scale_out.name, scale)


def run(plan: Plan, dst: Path, devices: list[torch.device], workers: int, *, skip: set[str] = frozenset(),
        on_item_done: Callable[[WorkItem], None] = lambda item: None,
        on_shard_finished: Callable[[str, str], None] = lambda name, digest: None) -> None:
    """Write every output shard of `plan` but those in `skip` (already finished) into `dst`, with
    `workers` workers spread over `devices`."""
    todo = [item for name, items in zip(plan.shard_names, plan.shards) if name not in skip for item in items]
    quantized = [item for item in todo if item.quantize]
    # Tensors copied unchanged go through the same host buffer, a chunk at a time.
    input_bytes = max([item.input_bytes for item in quantized]
                      + [copy_scratch_bytes(o.nbytes) for item in todo if not item.quantize for o in item.outputs],
                      default=0)
    output_bytes = max((sum(o.nbytes + DIRECT_ALIGNMENT for o in item.outputs[0::2]) for item in quantized), default=0)
    if any(device.type == "cuda" for device in devices):
        _cuda_backend()  # imported here, once: never by several workers at a time
    sources, shards = Sources(plan), OutputShards(plan, dst, on_shard_finished)
    items = iter(todo)
    take, allocate, failed = threading.Lock(), threading.Lock(), threading.Event()

    def work(device: torch.device) -> None:
        # torch's intra-op thread count is per thread: split the cores among the workers instead of
        # letting each spin up a team for every chunk.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            # Workers allocate their buffers one after the other: pinned host memory took 1.1 s for six
            # GPU workers at once on the H200 machine, none of which could start before all were done;
            # in turn, the first starts on the first item while the others still allocate.
            with allocate:
                worker = Worker(device, input_bytes, output_bytes)
            while not failed.is_set():
                with take:
                    item = next(items, None)
                if item is None:
                    return
                process(plan, item, sources, worker, shards.for_item(item))
                shards.item_done(item)
                on_item_done(item)
        except BaseException:
            failed.set()  # the other workers stop after their current item
            raise

    try:
        with ThreadPoolExecutor(workers, "quantize") as executor:
            for future in [executor.submit(work, devices[i % len(devices)]) for i in range(workers)]:
                future.result()
    except BaseException:
        shards.abort()
        raise
    finally:
        sources.close()
