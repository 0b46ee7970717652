"""The GPU engine on a CUDA machine (`pytest -m gpu`): bit-identical to the CPU path."""

from __future__ import annotations

import pytest
import torch

from quantize_moe.quantization import cuda

from quantize_moe.quantization import fp8
from quantize_moe.plan.options import Options
from quantize_moe.write.job import quantize_checkpoint
from quantize_moe.quantization.schemes import SCHEMES
from test_engine import shard_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("shape", [(4096, 1536), (300, 520), (7, 5)])
def test_kernel_bytes_equal_cpu(scheme, shape):
    w = (torch.randn(*shape) * torch.logspace(-4, 1, shape[0])[:, None]).to(torch.bfloat16)
    w[1] = 0
    cell = SCHEMES[scheme].cell(shape)
    cpu_q = torch.empty(shape, dtype=fp8.FP8_DTYPE)
    cpu_scale = fp8.quantize_cells(w, cell, cpu_q, "w")
    gpu_q = torch.empty(shape, dtype=fp8.FP8_DTYPE, device="cuda")
    gpu_scale = cuda.quantize_cells(w.cuda(), cell, gpu_q, "w")
    assert torch.equal(gpu_scale.cpu(), cpu_scale)
    assert torch.equal(gpu_q.cpu().view(torch.uint8), cpu_q.view(torch.uint8))


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_cuda_checkpoint_equals_cpu_checkpoint(tiny_checkpoint, block_friendly, tmp_path, scheme):
    src = block_friendly("mixtral") if scheme == "block" else tiny_checkpoint("mixtral")
    options = Options(scheme=scheme, max_shard_size=60_000)  # channel: compressed-tensors, bf16 scales
    quantize_checkpoint(src, tmp_path / "cpu", options, show_progress=False)
    devices = ",".join(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    quantize_checkpoint(src, tmp_path / "cuda", options, device=devices, workers=3, show_progress=False)
    assert shard_bytes(tmp_path / "cpu") == shard_bytes(tmp_path / "cuda")
