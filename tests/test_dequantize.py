"""FP8 weights dequantized through the 256-entry table give the bytes of the plain torch expression
`(q.float() * scale).to(dtype)`, in every scale layout and chunk size."""

from __future__ import annotations

import pytest
import torch

from quantize_moe.quantization import fp8
from quantize_moe.quantization.spec import MoEQuantSpec, expand_weight_scale, weight_cell

SPECS = {"tensor": MoEQuantSpec("tensor"), "channel": MoEQuantSpec("channel"),
         "block": MoEQuantSpec("block", "group", (128, 128)), "small block": MoEQuantSpec("block", "group", (4, 8))}


def plain(q: torch.Tensor, scale: torch.Tensor, spec: MoEQuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """What dequantize wrote before the fast paths: torch's cast times the scale repeated over every element."""
    return (q.float() * expand_weight_scale(scale[None], spec, (1, *q.shape))[0]).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", list(SPECS))
@pytest.mark.parametrize("shape", [(300, 260), (16, 16)])  # ragged blocks and one whole-tensor cell
def test_table_dequantize_equals_torch_for_every_byte_and_scale_layout(layout, shape, dtype):
    spec = SPECS[layout]
    generator = torch.Generator().manual_seed(0)
    q = torch.arange(shape[0] * shape[1]).remainder(256).to(torch.uint8)  # all 256 bytes, NaN ones too
    q = q[torch.randperm(q.numel(), generator=generator)].view(shape).view(fp8.FP8_DTYPE)
    cell = weight_cell(spec, shape)
    grid = fp8.grid_shape(shape, cell)
    # scales from subnormal products to overflowing ones
    scale = torch.exp2(torch.empty(grid).uniform_(-140, 120, generator=generator))
    expected = plain(q, scale.reshape(-1) if layout == "channel" else scale.reshape(grid), spec, dtype)
    for chunk in (fp8.CHUNK_ELEMENTS, 3 * shape[1]):  # one chunk, and chunks of 3 rows (or one cell row)
        out = fp8.dequantize_grid(q, scale, cell, torch.empty(shape, dtype=dtype), chunk)
        assert same_bytes(out, expected), (layout, chunk)
    assert torch.equal(fp8.FLOAT_OF_BYTE.view(torch.int32),
                       torch.arange(256, dtype=torch.uint8).view(fp8.FP8_DTYPE).float().view(torch.int32))
