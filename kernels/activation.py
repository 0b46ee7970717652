"""SiLU(gate) * up between the two grouped GEMMs.

The first GEMM writes gate and up side by side, [pairs, 2I]; this halves it
to [pairs, I]. `silu_mul` is the element-wise core, shared with the FP8
quantization kernel that fuses it (quant.py), so both compute it the same way.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def silu_mul(row_ptr, cols, mask, inter_size):
    """SiLU(gate) * up in fp32 for columns `cols` of one [2I] row (gate at 0, up at I)."""
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter_size, stride_x, stride_out, BLOCK: tl.constexpr):
    # One program per (row, BLOCK columns): a purely element-wise, bandwidth-bound pass.
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    values = silu_mul(x_ptr + row * stride_x, cols, mask, inter_size)
    tl.store(out_ptr + row * stride_out + cols, values.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[rows, 2I] -> [rows, I] in out_dtype (default: gate_up's dtype)."""
    rows, inter_size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter_size, dtype=out_dtype or gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(inter_size), 1024)
    grid = (rows, triton.cdiv(inter_size, block))
    _silu_and_mul_kernel[grid](gate_up, out, inter_size, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
