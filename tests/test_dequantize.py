"""`dequantize`'s fast paths give the bytes of the plain torch expression `(q.float() * scale).to(dtype)`:
the 256-entry table, the chunks, the row parts over the cores and the GPU."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantize_moe.adapters.reader import SourceReader
from quantize_moe.errors import UserError
from quantize_moe.plan.options import Options
from quantize_moe.quantization import fp8
from quantize_moe.quantization.spec import MoEQuantSpec, expand_weight_scale, weight_cell
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.tiny import to_block_fp8
from quantize_moe.write.dequantize import dequantize_checkpoint
from quantize_moe.write.job import quantize_checkpoint

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
    assert torch.equal(fp8.float_of_byte(torch.device("cpu")).view(torch.int32),
                       torch.arange(256, dtype=torch.uint8).view(fp8.FP8_DTYPE).float().view(torch.int32))


@pytest.mark.parametrize("rows,cell_rows,parts", [(300, 128, 3), (300, 1, 7), (300, 300, 4), (5, 128, 3), (1, 1, 4)])
def test_row_parts_cover_the_rows_once_on_cell_boundaries(rows, cell_rows, parts):
    ranges = fp8.row_parts(rows, cell_rows, parts)
    assert len(ranges) <= parts and ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(end == start for (_, end), (start, _) in zip(ranges, ranges[1:]))
    if cell_rows < rows:
        assert all(start % cell_rows == 0 for start, _ in ranges)


@pytest.fixture(scope="module")
def fp8_sources(tiny_checkpoint, block_friendly, tmp_path_factory):
    """FP8 checkpoints of every scale layout: ours per tensor and per channel, a DeepSeek-style block one."""
    root = tmp_path_factory.mktemp("dequantize")
    folders = {}
    for scheme in ("tensor", "channel"):
        folders[scheme] = root / scheme
        quantize_checkpoint(block_friendly("mixtral"), folders[scheme], Options(scheme=scheme), show_progress=False)
    folders["block"] = to_block_fp8(tiny_checkpoint("deepseek_v3"), root / "block", (32, 32))
    return folders


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_dequantize_writes_the_plain_torch_bytes_in_row_parts(fp8_sources, scheme, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # three row parts, whatever this machine has
    try:
        dequantize_checkpoint(fp8_sources[scheme], tmp_path / "bf16", device="cpu")
    finally:
        torch.set_num_threads(threads)
    source, written = SourceReader(Checkpoint(fp8_sources[scheme])), Checkpoint(tmp_path / "bf16")
    fp8_names = [name for name in source.names if source.scaled_alone(name)]
    assert fp8_names
    for name in fp8_names:
        scale, _ = source.scale_grid(name)
        q = source.checkpoint.get(name)
        expected = plain(q, scale.reshape(-1) if scheme == "channel" else scale, source.spec, torch.bfloat16)
        assert same_bytes(written.get(name), expected), name
    assert set(written.tensors) == set(source.names)


def test_dequantize_names_a_device_this_machine_lacks(fp8_sources, tmp_path):
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(UserError, match=f"--device {missing} is not available"):
        dequantize_checkpoint(fp8_sources["tensor"], tmp_path / "bf16", device=missing)
    assert not (tmp_path / "bf16").exists()


def test_dequantize_refuses_nan_bytes_naming_the_weight(fp8_sources, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(fp8_sources["tensor"], damaged)
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    shard = damaged / Checkpoint(damaged).tensors[name].file
    tensors = load_file(shard)
    tensors[name].view(torch.uint8)[3, 5] = 0x7F  # e4m3fn's NaN
    save_file(tensors, shard, {"format": "pt"})
    with pytest.raises(UserError, match=f"FP8 weight '{name}' dequantizes to NaN or Inf"):
        dequantize_checkpoint(damaged, tmp_path / "bf16", device="cpu")
    assert not list((tmp_path / "bf16").glob("*.safetensors*"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_dequantize_on_the_gpu_writes_the_cpu_bytes(fp8_sources, scheme, tmp_path):
    dequantize_checkpoint(fp8_sources[scheme], tmp_path / "cpu", device="cpu")
    dequantize_checkpoint(fp8_sources[scheme], tmp_path / "cuda", device="cuda")
    files = sorted(p.name for p in (tmp_path / "cpu").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "cuda").iterdir())
    for name in files:
        assert (tmp_path / "cpu" / name).read_bytes() == (tmp_path / "cuda" / name).read_bytes(), name
