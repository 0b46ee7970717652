"""FP8 (float8_e4m3fn) arithmetic: amax, scales, quantize and dequantize.

A scale is always the dequantization multiplier, `w ~= q.float() * scale`, with
`scale = amax / 448`. torch's cast does not saturate (out-of-range values become
NaN), so values are clamped first. Work is done in row chunks into preallocated
outputs: whole-tensor float32 temporaries of a 1-2 GB weight cost more in page
faults than the arithmetic itself.
"""

from __future__ import annotations

import torch

from quantize_moe.errors import UserError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
CHUNK_ELEMENTS = 1 << 22  # 4M elements: a 16 MB float32 temporary per chunk


def _row_chunks(rows: int, cols: int):
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _non_finite(name: str) -> UserError:
    return UserError(f"Tensor '{name}' contains NaN or Inf values; the checkpoint is corrupt or "
                     "was saved after a diverged training step, so it cannot be quantized.")


def finite_range(weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest and largest value of a non-empty `weight`; NaN or Inf is an error naming the tensor."""
    low, high = torch.aminmax(weight)
    if not (torch.isfinite(low) and torch.isfinite(high)):
        raise _non_finite(name)
    return low, high


def amax(weight: torch.Tensor, name: str) -> torch.Tensor:
    """Largest magnitude of `weight` as a float32 scalar; NaN or Inf is an error naming the tensor."""
    if weight.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    low, high = finite_range(weight, name)
    return torch.maximum(-low, high).float()


def row_amax(weight: torch.Tensor, name: str) -> torch.Tensor:
    """Per-row largest magnitude, float32 `[rows]`, computed chunk by chunk."""
    out = torch.empty(weight.shape[0], dtype=torch.float32)
    for start, end in _row_chunks(*weight.shape):
        low, high = torch.aminmax(weight[start:end], dim=1)
        out[start:end] = torch.maximum(-low, high).float()
    if not torch.isfinite(out).all():
        raise _non_finite(name)
    return out


def scale_from_amax(amax_value: torch.Tensor) -> torch.Tensor:
    """amax / 448, with 1.0 for all-zero rows or tensors so no NaN or Inf reaches the disk."""
    scale = amax_value.float() / FP8_MAX
    return torch.where(amax_value > 0, scale, torch.ones_like(scale))


def quantize(weight: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """Quantize a 2-D weight; `row_scale` is a scalar or one float32 scale per row."""
    rows, cols = weight.shape
    out = torch.empty((rows, cols), dtype=FP8_DTYPE)
    per_row = row_scale.dim() > 0
    # One float32 buffer reused for every chunk; the source (possibly a read-only mmap) is never written.
    buffer = torch.empty(min(rows, max(1, CHUNK_ELEMENTS // max(cols, 1))), cols, dtype=torch.float32)
    for start, end in _row_chunks(rows, cols):
        scale = row_scale[start:end, None] if per_row else row_scale
        chunk = buffer[:end - start]
        chunk.copy_(weight[start:end]).div_(scale).clamp_(-FP8_MAX, FP8_MAX)
        out[start:end].copy_(chunk)
    return out


def dequantize(q: torch.Tensor, row_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize` (up to FP8 rounding)."""
    scale = row_scale[:, None] if row_scale.dim() > 0 else row_scale
    return (q.float() * scale).to(dtype)


def rounding_bound(original: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Elementwise worst-case |dequantize(quantize(w)) - w| for e4m3, with `scale` broadcastable to
    `original`: half an ulp of 3 mantissa bits (2^-4 relative) for normal numbers, half the smallest
    subnormal (2^-10 * scale) below, plus float32 slack for the division."""
    return torch.maximum(original.float().abs() * 2.0**-4, scale * 2.0**-10) * (1 + 2.0**-20)
