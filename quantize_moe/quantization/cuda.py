"""Weight quantization on a GPU: the `quantize_cells`/`grid_amax` backend of `schemes.Scheme`.

Same arithmetic as `quantize_moe.quantization.fp8`, so the output is bit-identical: amax is
exact, `scale = amax / 448` and `w / scale` are IEEE divisions (`div_rn`, as
torch does on the CPU), values are clamped to +-448 and rounded to nearest-even
by the cast. A weight is walked in tiles; a scale covers a cell of it (whole
tensor, one row, or a 128x128 block).

When a cell is exactly one tile (block scales) one kernel reads each value
once and does amax, scale and cast. Otherwise a first kernel reduces each tile
and folds it into its cells' amax with an atomic max (on the float's bits:
non-negative floats order like their int32 patterns), and the cast kernel
derives the scales from that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantize_moe.quantization import fp8

TILE = (32, 256)  # rows, cols of a tile when cells are larger than a tile


@triton.jit
def _load_tile(w_ptr, rows, cols, BM: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    offsets = r.to(tl.int64)[:, None] * cols + c[None, :]
    return tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32), r, offsets, mask


@triton.jit
def _magnitude(x):
    """|x|, with NaN turned into +inf so the host's finiteness check sees it."""
    a = tl.abs(x)
    return tl.where(a == a, a, float("inf"))


@triton.jit
def _cell_amax_kernel(w_ptr, amax_bits_ptr, rows, cols, cell_rows, cell_cols, grid_cols,
                      BM: tl.constexpr, BN: tl.constexpr, ONE_ROW_CELL: tl.constexpr):
    x, r, _, _ = _load_tile(w_ptr, rows, cols, BM, BN)
    col_cell = (tl.program_id(1) * BN) // cell_cols
    row_amax = tl.max(_magnitude(x), axis=1)
    if ONE_ROW_CELL:  # the whole tile lies in one row of cells: one atomic
        cell = (tl.program_id(0) * BM // cell_rows) * grid_cols + col_cell
        tl.atomic_max(amax_bits_ptr + cell, tl.max(row_amax, axis=0).to(tl.int32, bitcast=True))
    else:
        cells = (r // cell_rows) * grid_cols + col_cell
        tl.atomic_max(amax_bits_ptr + cells, row_amax.to(tl.int32, bitcast=True), mask=r < rows)


@triton.jit
def _quantize_kernel(w_ptr, q_ptr, amax_ptr, scale_ptr, rows, cols, cell_rows, cell_cols, grid_cols,
                     FP8_MAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LOCAL_AMAX: tl.constexpr):
    x, r, offsets, mask = _load_tile(w_ptr, rows, cols, BM, BN)
    col_start = tl.program_id(1) * BN
    cells = (r // cell_rows) * grid_cols + col_start // cell_cols
    if LOCAL_AMAX:  # the tile is exactly one cell
        amax = tl.zeros([BM], dtype=tl.float32) + tl.max(tl.max(_magnitude(x), axis=1), axis=0)
        tl.store(amax_ptr + cells, amax, mask=(r % cell_rows == 0) & (r < rows))
    else:
        amax = tl.load(amax_ptr + cells, mask=r < rows, other=0.0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + offsets, q.to(q_ptr.dtype.element_ty), mask=mask)
    first_of_cell = (r % cell_rows + col_start % cell_cols == 0) & (r < rows)
    tl.store(scale_ptr + cells, scale, mask=first_of_cell)


def _check_finite(amax: torch.Tensor, name: str) -> None:
    if not torch.isfinite(amax).all():
        raise fp8.non_finite(name)


def grid_amax(weight: torch.Tensor, cell: tuple[int, int], name: str) -> torch.Tensor:
    """Largest magnitude of each cell of a contiguous 2-D CUDA weight, float32 `fp8.grid_shape`."""
    rows, cols = weight.shape
    cell_rows, cell_cols = min(cell[0], rows), min(cell[1], cols)
    grid_rows, grid_cols = fp8.grid_shape(weight.shape, cell)
    bm, bn = TILE
    if cell_cols < cols and cell_cols % bn:
        bn = cell_cols  # a tile must not straddle two columns of cells
    bits = torch.zeros(grid_rows, grid_cols, dtype=torch.int32, device=weight.device)
    _cell_amax_kernel[(triton.cdiv(rows, bm), triton.cdiv(cols, bn))](
        weight, bits, rows, cols, cell_rows, cell_cols, grid_cols,
        BM=bm, BN=bn, ONE_ROW_CELL=cell_rows >= rows or cell_rows % bm == 0)
    amax = bits.view(torch.float32)
    _check_finite(amax, name)
    return amax


def quantize_cells(weight: torch.Tensor, cell: tuple[int, int], out: torch.Tensor, name: str,
                   amax: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8.quantize_cells` for contiguous CUDA tensors, on the current stream."""
    rows, cols = weight.shape
    cell_rows, cell_cols = min(cell[0], rows), min(cell[1], cols)
    grid_rows, grid_cols = fp8.grid_shape(weight.shape, cell)
    scale = torch.empty(grid_rows, grid_cols, dtype=torch.float32, device=weight.device)
    fused = amax is None and cell_rows <= 128 and cell_cols <= 128 and all(
        n & (n - 1) == 0 for n in (cell_rows, cell_cols))
    if fused:
        bm, bn = cell_rows, cell_cols
        amax = torch.empty_like(scale)
    else:
        if amax is None:
            amax = grid_amax(weight, cell, name)
        bm, bn = TILE
        if cell_cols < cols and cell_cols % bn:
            bn = cell_cols
    _quantize_kernel[(triton.cdiv(rows, bm), triton.cdiv(cols, bn))](
        weight, out, amax, scale, rows, cols, cell_rows, cell_cols, grid_cols,
        FP8_MAX=fp8.FP8_MAX, BM=bm, BN=bn, LOCAL_AMAX=fused, num_warps=8 if bm * bn >= 8192 else 4)
    if fused:
        _check_finite(amax, name)
    return scale
