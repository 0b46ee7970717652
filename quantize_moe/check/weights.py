"""Offline numeric check of a produced checkpoint against its source, layer by layer.

Loads the stacked experts of both through the same FusedMoE weight loader, a few
experts at a time, and compares each expert projection with the FP8 e4m3 rounding
bound in row blocks of a few MB of float32: neither a layer nor a whole projection
is ever held in float32, so memory stays at a few experts whatever the layer or
model size. Runs on the GPU when there is one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from quantize_moe.quantization import fp8
from quantize_moe.check.moe_layers import MoECheckpoint
from quantize_moe.moe.layer import FusedMoE
from quantize_moe.quantization.spec import MoEQuantSpec, expand_weight_scale
from quantize_moe.write.pipeline import pick_device


@dataclass(frozen=True)
class LayerWeightCheck:
    layer: int
    relative_error: float  # ||deq - w|| / ||w|| over w13 and w2 together
    worst_bound_ratio: float  # max |deq - w| / rounding bound: <= 1 means within FP8 rounding

    @property
    def ok(self) -> bool:
        return self.worst_bound_ratio <= 1.0


class RoundingError:
    """Squared error, squared norm and worst error / rounding bound, summed over matrices on their
    device (one synchronisation per layer, not per block), through three float32 block buffers
    allocated once: fresh multi-MB temporaries per block cost more in page faults than the arithmetic."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # error², norm², worst ratio
        self.buffers = torch.empty(3, 0, device=device)

    def reset(self) -> None:
        """Start summing another set of matrices, keeping the buffers."""
        self.sums.zero_()

    def add(self, original: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, spec: MoEQuantSpec,
            original_scale: tuple[torch.Tensor, MoEQuantSpec] | None = None) -> None:
        """One 2-D FP8 matrix `q` with its own `scale` (scalar, `[N]`/`[N, 1]` or the block grid) against
        `original` (itself FP8 with `original_scale` = (scale, spec) for a pre-quantized source),
        `fp8.CHUNK_ELEMENTS` at a time in rows that start on block boundaries of both."""
        rows, cols = q.shape
        scale = scale.to(self.device)
        if original_scale is not None:
            original_scale = original_scale[0].to(self.device), original_scale[1]
        step = max(1, fp8.CHUNK_ELEMENTS // max(cols, 1))
        for blocks in (spec, original_scale and original_scale[1]):
            if blocks and blocks.weight == "block":
                step = max(blocks.block_shape[0], step - step % blocks.block_shape[0])
        if self.buffers.shape[1] < min(rows, step) * cols:
            self.buffers = torch.empty(3, min(rows, step) * cols, device=self.device)
        for start in range(0, rows, step):
            end = min(rows, start + step)
            w, difference, bound = (b[:(end - start) * cols].view(end - start, cols) for b in self.buffers)
            shape, s = _scale_rows(scale, spec, start, end, cols)
            w.copy_(original[start:end])
            if original_scale is not None:
                source_shape, source_scale = _scale_rows(*original_scale, start, end, cols)
                w.view(source_shape).mul_(source_scale)
            difference.copy_(q[start:end]).view(shape).mul_(s).sub_(w.view(shape))
            fp8.rounding_bound(w.view(shape), s, out=bound.view(shape))
            self.sums[0] += torch.dot(difference.view(-1), difference.view(-1))
            self.sums[1] += torch.dot(w.view(-1), w.view(-1))
            self.sums[2] = torch.maximum(self.sums[2], difference.abs_().div_(bound).max())

    def result(self) -> tuple[float, float]:
        """(relative error, worst error / bound)."""
        err, norm, worst = self.sums.tolist()
        return (err / max(norm, 1e-300)) ** 0.5, worst


def _scale_rows(scale: torch.Tensor, spec: MoEQuantSpec, start: int, end: int,
                cols: int) -> tuple[tuple[int, ...], torch.Tensor]:
    """One matrix's scale over its rows [start, end): (a shape to view those rows in, the scale
    broadcastable to that view). Whole 128x128 blocks are viewed as [row blocks, bn, col blocks, bk]
    against the scale grid itself, so no block scale is repeated over every element (that copy per
    row block cost as much as the comparison); ragged blocks expand the scale over the rows."""
    rows = end - start
    if spec.weight == "block":
        bn, bk = spec.block_shape
        if start % bn == 0 and rows % bn == 0 and cols % bk == 0:
            return (rows // bn, bn, cols // bk, bk), scale[start // bn:end // bn, :, None].unsqueeze(1)
        part = scale[start // bn:-(-end // bn)].unsqueeze(0)
    else:
        part = scale.reshape(1) if spec.weight == "tensor" else scale.reshape(-1)[start:end].reshape(1, -1)
    return (rows, cols), expand_weight_scale(part, spec, (1, rows, cols))[0]


def compare_experts(error: RoundingError, original: FusedMoE, quantized: FusedMoE) -> None:
    """Add every expert projection of `quantized` against the same expert of `original` to `error`: both
    loaded by the same weight loader (and post-processed: a max-requantized w13 is what is compared)."""
    for w, w_scale, q, scale in zip((original.w13_weight, original.w2_weight), original.quant_method.scales(original),
                                    (quantized.w13_weight, quantized.w2_weight), quantized.quant_method.scales(quantized)):
        for e in range(w.shape[0]):
            source_scale = None if w_scale is None else (w_scale[e], original.quant_method.spec)
            error.add(w.data[e], q.data[e], scale[e], quantized.quant_method.spec, source_scale)


def layer_weight_check(layer: int, original: FusedMoE, quantized: FusedMoE) -> LayerWeightCheck:
    """One whole MoE layer, already loaded on its device (as `validate` loads it), against the source."""
    error = RoundingError(quantized.w13_weight.device)
    compare_experts(error, original, quantized)
    return LayerWeightCheck(layer, *error.result())


def check_expert_weights(src: str | Path, dst: str | Path, adapter: str | None = None,
                         device: str = "auto") -> list[LayerWeightCheck]:
    """Every MoE layer's experts of DST against SRC; the next chunk of experts is read (SRC's and DST's
    in a thread each) while this one is compared, so reading and arithmetic overlap."""
    original, quantized = MoECheckpoint.open(src, adapter), MoECheckpoint.open(dst, adapter)
    torch_device = pick_device(device)
    chunks = [(layer, experts) for layer in sorted(original.layers) for experts in original.expert_chunks(layer)]

    results, error = [], None
    with ThreadPoolExecutor(2) as reader:
        def load(index: int):
            return [reader.submit(c.load_experts, *chunks[index], torch_device) for c in (original, quantized)]

        ahead = load(0) if chunks else None
        for index, (layer, experts) in enumerate(chunks):
            a, b = (future.result() for future in ahead)
            ahead = load(index + 1) if index + 1 < len(chunks) else None
            error = error or RoundingError(torch_device)  # one per layer, its buffers freed after it
            compare_experts(error, a, b)
            del a, b
            if index + 1 == len(chunks) or chunks[index + 1][0] != layer:
                results.append(LayerWeightCheck(layer, *error.result()))
                error = None
    original.checkpoint.close()
    quantized.checkpoint.close()
    return results
