"""The Triton fused-MoE kernels on a CUDA GPU against the torch reference (`pytest -m gpu`).

Tolerances follow the reference design's tests (shared/reference/kernel-anchors.md),
stated as ||out - ref|| / ||ref||: unquantized against a float64 reference;
FP8 against the float64 reference that quantizes activations the same way, so
only kernel rounding (bf16 intermediates, FP8 accumulation) is left.
"""

import pytest
import torch

from moe_inputs import MODES, STATIC, assert_valid_alignment, quantized, random_problem, relative_error, with_static_scales
from quantize_moe.kernels import fused_experts
from quantize_moe.kernels.align import moe_align_block_size
from quantize_moe.kernels.quant import quantize_fp8
from quantize_moe.moe.reference import FP8_MAX_INV, fused_experts_reference, quantize_activation

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# T, H, I, E, k: T=1; T*k not a multiple of BLOCK_M; H, I not multiples of 128; E=256 with top-8.
SHAPES = [
    (1, 256, 128, 8, 2),
    (7, 320, 200, 8, 3),
    (33, 512, 384, 16, 4),
    (130, 1024, 256, 256, 8),
    (257, 2048, 768, 64, 6),
]
FP8_TOLERANCE = 3.5e-2
# Launch configs the tuner may pick beside the shipped ones: split-K on both GEMMs (a per-GEMM entry),
# a block-scale N tile inside one 128 group (one scale per K step) and one wider (a scale per column),
# weight tiles through TMA (N tiles running into the next expert's rows), alone and with split-K, and a
# persistent grid.
_BASE = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
VARIANTS = {
    "split-k": dict(gemm1=dict(_BASE, SPLIT_K=4), gemm2=dict(_BASE, BLOCK_SIZE_N=32, SPLIT_K=3)),
    "n64": _BASE,
    "n256": dict(_BASE, BLOCK_SIZE_M=64, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3),
    "tma": dict(_BASE, BLOCK_SIZE_M=64, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, TMA_B=True),
    "tma-split-k": dict(gemm1=dict(_BASE, SPLIT_K=2, TMA_B=True), gemm2=dict(_BASE, BLOCK_SIZE_N=128, TMA_B=True)),
    # Block scales applied by rescaling the accumulator: one scale per N tile and K step, and one per column.
    "rescale": dict(_BASE, BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, GROUP_SIZE_M=8, num_stages=3, TMA_B=True,
                    RESCALE_ACC=True),
    "rescale-n256": dict(_BASE, BLOCK_SIZE_M=64, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8,
                         num_stages=3, RESCALE_ACC=True),
    # A persistent grid: each program walks several tiles, with and without TMA.
    "persistent": dict(_BASE, BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, GROUP_SIZE_M=8, num_stages=3, PERSISTENT=True),
    "persistent-tma-n256": dict(_BASE, BLOCK_SIZE_M=64, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8,
                                num_stages=3, TMA_B=True, PERSISTENT=True),
}


@pytest.fixture(autouse=True)
def poisoned_allocator():
    """Fill the caching allocator's free memory with NaN, so unwritten outputs show up as NaN."""
    torch.empty(1 << 28, dtype=torch.float32, device="cuda").fill_(float("nan"))
    yield
    torch.cuda.synchronize()


def _check(problem, tolerance, config=None):
    out = fused_experts(*problem.args(), **problem.kwargs(), config=config)
    ref = fused_experts_reference(*problem.args(), **problem.kwargs(), compute_dtype=torch.float64)
    assert out.dtype == problem.hidden_states.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    error = relative_error(out, ref)
    assert error < tolerance, error
    return out, ref


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 1e-2), (torch.float16, 3e-3)], ids=["bf16", "fp16"])
def test_unquantized(shape, dtype, tolerance):
    _check(random_problem(*shape, dtype=dtype, device="cuda"), tolerance)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_fp8(shape, mode):
    problem = quantized(random_problem(*shape, dtype=torch.bfloat16, device="cuda"), MODES[mode])
    out, _ = _check(problem, FP8_TOLERANCE)
    # FP8 activations cost accuracy against the unquantized-activation layer, but boundedly.
    exact = fused_experts_reference(*problem.args(), **problem.kwargs(), compute_dtype=torch.float64,
                                    quantize_activations=False)
    assert relative_error(out, exact) < 0.1


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("headroom", [1.0, 0.8])
def test_fp8_static_activations(shape, headroom):
    """Static input scales (calibrated on these tokens, or 0.8 of that: the largest inputs saturate)."""
    problem = with_static_scales(random_problem(*shape, dtype=torch.bfloat16, device="cuda"), headroom)
    out, _ = _check(problem, FP8_TOLERANCE)
    exact = fused_experts_reference(*problem.args(), **problem.kwargs(), compute_dtype=torch.float64,
                                    quantize_activations=False)
    assert relative_error(out, exact) < (0.1 if headroom == 1.0 else 0.2)


@pytest.mark.parametrize("variant", ["split-k", "tma", "persistent"])
def test_static_activations_in_launch_variants(variant):
    problem = with_static_scales(random_problem(33, 640, 320, 16, 4, dtype=torch.bfloat16, device="cuda"), 0.8)
    _check(problem, FP8_TOLERANCE, VARIANTS[variant])


@pytest.mark.parametrize("fuse_silu_mul", [False, True])
def test_static_activation_quantization_matches_reference(fuse_silu_mul):
    """The given scale, values past 448 x scale saturated, like the torch reference (bitwise unfused)."""
    x = (torch.randn(67, 2 * 700, device="cuda") * 3).to(torch.bfloat16)
    values = x.float()
    if fuse_silu_mul:
        g, u = values.chunk(2, dim=1)
        values = torch.nn.functional.silu(g) * u
    scale = (values.abs().max() * FP8_MAX_INV * 0.7).reshape(1)
    q, out_scale = quantize_fp8(x, STATIC, fuse_silu_mul=fuse_silu_mul, static_scale=scale)
    q_ref, _ = quantize_activation(values, STATIC, scale)
    assert torch.equal(out_scale, scale) and q.float().abs().max() == 448
    if fuse_silu_mul:  # sigmoid's last bit can round to the neighbouring e4m3 value
        torch.testing.assert_close(q.float(), q_ref.float(), rtol=2 ** -3, atol=0)
    else:
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", ["bf16", *MODES])
def test_launch_variants(mode, variant):
    """H and 2I = 640 are no multiple of 256: the last N tile runs past an expert's rows."""
    problem = random_problem(33, 640, 320, 16, 4, dtype=torch.bfloat16, device="cuda")
    if mode == "bf16":
        _check(problem, 1e-2, VARIANTS[variant])
    else:
        _check(quantized(problem, MODES[mode]), FP8_TOLERANCE, VARIANTS[variant])


@pytest.mark.parametrize("mode", MODES)
def test_activation_quantization_matches_reference_bitwise(mode):
    quant = MODES[mode]
    x = (torch.randn(67, 1000, device="cuda") * torch.rand(67, 1, device="cuda") * 10).to(torch.bfloat16)
    q, scale = quantize_fp8(x, quant)
    q_ref, scale_ref = quantize_activation(x.float(), quant)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("mode", MODES)
def test_fused_silu_mul_quantization(mode):
    """Fused SiLU·mul + quantization equals quantizing the fp32 SiLU·mul (up to sigmoid's last bit)."""
    quant = MODES[mode]
    gate_up = torch.randn(67, 2 * 700, device="cuda", dtype=torch.bfloat16)
    q, scale = quantize_fp8(gate_up, quant, fuse_silu_mul=True)
    g, u = gate_up.float().chunk(2, dim=1)
    q_ref, scale_ref = quantize_activation(torch.nn.functional.silu(g) * u, quant)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
    assert same > 0.999
    # A last-bit difference can round to the neighbouring e4m3 value: at most 2^-3 apart, relatively.
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=2 ** -3, atol=0)


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 8, 256, 16), (4096, 8, 256, 64), (1000, 2, 8, 128)])
def test_align(tokens, top_k, experts, block_m):
    topk_ids = torch.rand(tokens, experts, device="cuda").argsort(dim=1)[:, :top_k].int()
    assert_valid_alignment(topk_ids, block_m, experts, *moe_align_block_size(topk_ids, block_m, experts))


def test_cuda_graph_replay_with_new_inputs():
    """fused_experts needs no host sync: capture once, replay on different routing."""
    problem = quantized(random_problem(64, 512, 256, 16, 4, dtype=torch.bfloat16, device="cuda"), MODES["fp8-block128"])
    fused_experts(*problem.args(), **problem.kwargs())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(*problem.args(), **problem.kwargs())
    fresh = random_problem(64, 512, 256, 16, 4, dtype=torch.bfloat16, device="cuda")
    problem.hidden_states.copy_(fresh.hidden_states)
    problem.topk_ids.copy_(fresh.topk_ids)
    problem.topk_weights.copy_(fresh.topk_weights)
    graph.replay()
    ref = fused_experts_reference(*problem.args(), **problem.kwargs(), compute_dtype=torch.float64)
    assert relative_error(out, ref) < FP8_TOLERANCE
