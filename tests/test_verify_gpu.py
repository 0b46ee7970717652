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


def test_verify_on_the_gpu_reads_each_layer_once_and_still_catches_a_wrong_expert(block_friendly, tmp_path):
    """On a GPU the expert check reads the layers validate loaded: a damaged expert fails it there."""
    from static_checkpoint import edit_shards

    src, dst = block_friendly("mixtral"), tmp_path / "fp8"
    quantize_checkpoint(src, dst, Options(scheme="block"), show_progress=False)
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    edit_shards(dst, lambda tensors: name in tensors and tensors.update(
        {name: (tensors[name].float() * 1.5).to(tensors[name].dtype)}))
    (dst / "quantize-moe-manifest.json").unlink()  # as another tool's output: the hashes would stop it first
    failures = {f.check: f.message + " ".join(f.examples) for f in verify(dst, Checkpoint(src)).findings
                if f.status == "fail"}
    assert "numerics: experts" in failures and "layer 1" in failures["numerics: experts"], failures
