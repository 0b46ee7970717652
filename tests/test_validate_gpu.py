"""`validate` through the Triton kernels on a CUDA GPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantize_moe.write.job import quantize_checkpoint
from quantize_moe.check.validate import validate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v2"])
def test_triton_validation_passes_and_agrees_with_the_cpu_reference(tiny_checkpoint, tmp_path, model_type):
    src = tiny_checkpoint(model_type)
    quantize_checkpoint(src, tmp_path / "fp8", show_progress=False)
    gpu = validate(src, tmp_path / "fp8", tokens=333, device="cuda")
    cpu = validate(src, tmp_path / "fp8", tokens=333, device="cpu")
    assert gpu.path == "triton" and gpu.passed, gpu.layers
    for on_gpu, on_cpu in zip(gpu.layers, cpu.layers):
        assert on_gpu.bf16_kernel_error < 1e-2 and on_gpu.fp8_kernel_error < 2e-2
        assert on_gpu.experts_with_tokens == on_cpu.experts_with_tokens
        assert on_gpu.relative_error == pytest.approx(on_cpu.relative_error, rel=0.1)


def test_triton_validation_fails_a_mis_scaled_expert(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("mixtral", max_shard_size="1GB")
    quantize_checkpoint(src, tmp_path / "fp8", show_progress=False)
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    tensors["model.layers.0.block_sparse_moe.experts.1.w2.weight_scale"] *= 8
    save_file(tensors, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    report = validate(src, tmp_path / "fp8", tokens=256, device="cuda")
    assert [r.passed for r in report.layers] == [False, True]
