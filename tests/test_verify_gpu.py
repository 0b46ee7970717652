"""`verify --against`'s numeric checks on a CUDA GPU agree with the CPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from quantize_moe.check.verify import verify
from quantize_moe.check.weights import check_expert_weights
from quantize_moe.plan.options import Options
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.write.job import quantize_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_weight_checks_on_the_gpu_agree_with_the_cpu(block_friendly, tmp_path, scheme):
    src = block_friendly("mixtral")
    quantize_checkpoint(src, tmp_path / "fp8", Options(scheme=scheme), show_progress=False)
    gpu, cpu = (check_expert_weights(src, tmp_path / "fp8", device=device) for device in ("cuda", "cpu"))
    assert all(layer.ok for layer in gpu)
    for on_gpu, on_cpu in zip(gpu, cpu, strict=True):
        assert on_gpu.relative_error == pytest.approx(on_cpu.relative_error, rel=1e-4)
        assert on_gpu.worst_bound_ratio == pytest.approx(on_cpu.worst_bound_ratio, rel=1e-4)
    report = verify(tmp_path / "fp8", Checkpoint(src))  # the other FP8 tensors too, on the GPU
    assert report.ok, report.findings
