"""FP8 activation quantization: dynamic per token, per tensor, per token-group, or static.

One kernel serves all three. A program owns one (row, group) pair, where a
group is `group_size` consecutive columns (the whole row for per-token
scales, 128 for block-quantized weights). It walks its group twice in BLOCK
chunks: first for the absolute maximum (scale = amax / 448), then to divide
and round to float8_e4m3fn. With a per-tensor scale the scale comes from
torch (a global reduction) and only the second walk runs; a static scale (calibrated, from the
checkpoint) is given and takes the same path.

With FUSE_SILU_MUL the values are SiLU(gate) * up computed on the fly from a
[rows, 2I] GEMM output, so the intermediate activation is never written in
bf16: one read of gate/up per walk, one fp8 write.

The formula (amax * (1/448), clamped, then an IEEE division and a saturating
round-to-nearest cast) is the one in `quantize_moe.moe.reference`, so the
kernels and the reference quantize identically.
"""

import torch
import triton
import triton.language as tl

from quantize_moe.kernels.activation import silu_and_mul, silu_mul
from quantize_moe.quantization.spec import MoEQuantSpec
from quantize_moe.moe.reference import FP8_DTYPE, FP8_MAX, FP8_MAX_INV, MIN_SCALE


@triton.jit
def _load_values(row_ptr, cols, mask, num_cols, FUSE_SILU_MUL: tl.constexpr):
    if FUSE_SILU_MUL:
        return silu_mul(row_ptr, cols, mask, num_cols)
    return tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, scale_ptr,
    num_cols, group_size, stride_x, stride_q, stride_scale,
    FP8_MAX: tl.constexpr, FP8_MAX_INV: tl.constexpr, MIN_SCALE: tl.constexpr,
    FUSE_SILU_MUL: tl.constexpr, STATIC_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    group = tl.program_id(1)
    start = group * group_size
    end = tl.minimum(start + group_size, num_cols)
    x_row = x_ptr + row * stride_x

    if STATIC_SCALE:
        scale = tl.load(scale_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for chunk in range(start, end, BLOCK):
            cols = chunk + tl.arange(0, BLOCK)
            values = _load_values(x_row, cols, cols < end, num_cols, FUSE_SILU_MUL)
            amax = tl.maximum(amax, tl.abs(values))
        scale = tl.maximum(tl.max(amax, axis=0) * FP8_MAX_INV, MIN_SCALE)
        tl.store(scale_ptr + row * stride_scale + group, scale)

    for chunk in range(start, end, BLOCK):
        cols = chunk + tl.arange(0, BLOCK)
        mask = cols < end
        values = _load_values(x_row, cols, mask, num_cols, FUSE_SILU_MUL)
        scaled = tl.clamp(tl.math.div_rn(values, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, scaled.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_fp8(x: torch.Tensor, quant: MoEQuantSpec, fuse_silu_mul: bool = False,
                 static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [rows, K] activations as `quant.activation` says; returns (q fp8, scale float32).

    Scale shapes: token [rows, 1], tensor and static [1], group [rows, ceil(K / bk)].
    With fuse_silu_mul, x is a [rows, 2K] gate/up tensor and SiLU(gate) * up is quantized (a static
    scale needs no pass over the whole activation first, so it stays fused).
    """
    if quant.activation == "tensor" and fuse_silu_mul:
        # A per-tensor scale needs the whole activation first: materialize it, in
        # fp32 so that it is quantized from the same values as in the fused path.
        x, fuse_silu_mul = silu_and_mul(x, torch.float32), False
    rows = x.shape[0]
    num_cols = x.shape[1] // 2 if fuse_silu_mul else x.shape[1]
    q = torch.empty(rows, num_cols, dtype=FP8_DTYPE, device=x.device)

    if quant.static:
        if static_scale is None:
            raise ValueError("static activations need their input scale")
        group_size, scale = num_cols, static_scale.float().reshape(1).to(x.device)
    elif quant.activation == "tensor":
        group_size = num_cols
        scale = (x.abs().amax().float() * FP8_MAX_INV).clamp(min=MIN_SCALE).reshape(1)
    else:
        group_size = num_cols if quant.activation == "token" else quant.block_shape[1]
        scale = torch.empty(rows, triton.cdiv(num_cols, group_size), dtype=torch.float32, device=x.device)
    grid = (rows, triton.cdiv(num_cols, group_size))
    _quantize_groups_kernel[grid](
        x, q, scale,
        num_cols, group_size, x.stride(0), q.stride(0), scale.stride(0),
        FP8_MAX=FP8_MAX, FP8_MAX_INV=FP8_MAX_INV, MIN_SCALE=MIN_SCALE,
        FUSE_SILU_MUL=fuse_silu_mul, STATIC_SCALE=quant.activation in ("tensor", "static"),
        BLOCK=min(triton.next_power_of_2(group_size), 1024),
    )
    return q, scale
