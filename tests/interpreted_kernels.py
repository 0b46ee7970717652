"""The Triton kernels under TRITON_INTERPRET=1, run by test_kernels.py in a subprocess.

Not collected by a plain `pytest` run (no test_ prefix): the interpreter must
be on before the kernels are decorated. Operands are float32, or FP8
quantized with torch: the interpreter gets bf16 dots and casts to fp8 wrong,
while fp32 and fp8 x fp8 dots are right.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from moe_inputs import MODES, STATIC, assert_valid_alignment, quantized, random_problem, relative_error, with_static_scales
from quantize_moe.kernels import fused_experts
from quantize_moe.kernels.activation import silu_and_mul
from quantize_moe.kernels.align import moe_align_block_size
from quantize_moe.kernels.fused_moe import gemm_output, invoke_grouped_gemm
from quantize_moe.kernels.quant import quantize_fp8
from quantize_moe.moe.reference import dequantize_activation, dequantize_weight, fused_experts_reference, quantize_activation

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

SMALL = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=2, num_warps=4, num_stages=1)
# Per-GEMM entries as tune_moe.py writes them: split-K on either GEMM, with split counts that leave
# some programs a shorter (or empty) share of the K loop.
SPLIT = dict(gemm1=dict(SMALL, SPLIT_K=3), gemm2=dict(SMALL, BLOCK_SIZE_N=16, SPLIT_K=2))
TMA = dict(SMALL, TMA_B=True)  # the N tile runs past an expert's rows: into the next expert's, or off the end
PERSISTENT = dict(SMALL, PERSISTENT=True)  # 3 programs walk all tiles (fused_moe._program_slots off the GPU)


@pytest.mark.parametrize("config", [SMALL, SPLIT, TMA, PERSISTENT], ids=["one-config", "split-k", "tma", "persistent"])
@pytest.mark.parametrize("shape", [(1, 64, 48, 4, 1), (19, 96, 40, 8, 3)])  # T, H, I, E, k; T*k not a multiple of 16
def test_fused_experts_fp32(shape, config):
    p = random_problem(*shape)
    out = fused_experts(*p.args(), config=config)
    ref = fused_experts_reference(*p.args(), compute_dtype=torch.float64)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert relative_error(out, ref) < 1e-5


# BLOCK_SIZE_K divides the 128 quantization group; BLOCK_SIZE_N 64 divides it too (one weight scale per
# N-tile and K step), 256 does not (a scale per column).
FP8_CONFIGS = {
    "n64": dict(SMALL, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64),
    "n256": dict(SMALL, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64),
    "n64-split-k": dict(SMALL, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, SPLIT_K=2),
    "n64-tma": dict(SMALL, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, TMA_B=True),
    "n256-tma-split-k": dict(SMALL, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, TMA_B=True, SPLIT_K=3),
    # Block scales applied by rescaling the accumulator (other modes ignore RESCALE_ACC).
    "n64-rescale": dict(SMALL, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, RESCALE_ACC=True),
    "n256-rescale-split-k": dict(SMALL, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, SPLIT_K=3, RESCALE_ACC=True),
    "n64-tma-persistent": dict(SMALL, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, TMA_B=True, PERSISTENT=True),
    "n256-rescale-persistent": dict(SMALL, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, RESCALE_ACC=True, PERSISTENT=True),
}


@pytest.mark.parametrize("config", FP8_CONFIGS.values(), ids=FP8_CONFIGS)
@pytest.mark.parametrize("mode", MODES)
def test_grouped_gemm_fp8_operands(mode, config):
    """Both GEMMs with FP8 inputs quantized by torch: scales applied as the spec says."""
    tokens, top_k, experts = 6, 2, 4
    p = quantized(random_problem(tokens, 256, 160, experts, top_k), MODES[mode])
    align = _aligned(p, config)
    assert _gate_up_error(p, quantize_activation(p.hidden_states, p.quant), align) < 1e-5

    flat_ids = p.topk_ids.reshape(-1).long()
    act, act_scale = quantize_activation(torch.randn(tokens * top_k, p.w2.shape[2]), p.quant)
    out = _poisoned_output(tokens * top_k, p.w2.shape[1], config)
    weights = p.topk_weights.reshape(-1)
    invoke_grouped_gemm(act, act_scale, p.w2, p.w2_scale, out, weights, a_row_divisor=1, **align)
    act_exact = dequantize_activation(act, act_scale, p.quant, torch.float64)
    w2 = dequantize_weight(p.w2, p.w2_scale, p.quant, torch.float64)[flat_ids]
    expected = torch.einsum("pi,phi->ph", act_exact, w2) * weights.double().unsqueeze(1)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("config", ["n64", "n256-tma-split-k", "n64-tma-persistent"])
def test_grouped_gemm_with_static_activation_scales(config):
    """Static activations: inputs quantized (with saturation) by the checkpoint's one scale, which the
    GEMM applies once per tile like a dynamic per-tensor scale."""
    p = with_static_scales(random_problem(6, 256, 160, 4, 2), headroom=0.8)
    q, scale = quantize_activation(p.hidden_states, STATIC, p.a13_scale)
    assert torch.equal(scale, p.a13_scale) and q.float().abs().max() == 448  # the largest saturate
    assert _gate_up_error(p, (q, scale), _aligned(p, FP8_CONFIGS[config])) < 1e-5


@pytest.mark.parametrize("fuse_silu_mul", [False, True])
def test_static_quantization_uses_the_given_scale(fuse_silu_mul):
    """The kernel takes the checkpoint's scale as it is (values: on the GPU, where fp8 casts are right)."""
    x = torch.randn(5, 2 * 300)
    _, scale = quantize_fp8(x, STATIC, fuse_silu_mul=fuse_silu_mul, static_scale=torch.tensor([0.003]))
    assert scale.tolist() == [torch.tensor(0.003).item()]
    with pytest.raises(ValueError, match="input scale"):
        quantize_fp8(x, STATIC)


def test_block_scales_over_many_orders_of_magnitude_and_zero():
    """Block scales that jump by up to 1e12 from one K step to the next, zero weight scales (an all-zero
    block) and all-zero activation groups: both ways of applying block scales stay exact and finite."""
    quant = MODES["fp8-block128"]
    p = quantized(random_problem(8, 768, 160, 4, 2), quant)
    p.w13_scale *= torch.logspace(-6, 6, p.w13_scale.shape[2])
    p.w13_scale[0, 0, 2] = 0
    p.hidden_states[:, 128:256] = 0
    for config in (FP8_CONFIGS[name] for name in ("n64", "n256", "n64-rescale", "n256-rescale-split-k")):
        assert _gate_up_error(p, quantize_activation(p.hidden_states, quant), _aligned(p, config)) < 1e-5


def _aligned(p, config) -> dict:
    """The routing and launch arguments of invoke_grouped_gemm for problem p."""
    sorted_ids, expert_ids, num_post = moe_align_block_size(p.topk_ids, config["BLOCK_SIZE_M"], p.w13.shape[0])
    return dict(sorted_token_ids=sorted_ids, expert_ids=expert_ids, num_tokens_post_padded=num_post,
                quant=p.quant, config=config)


def _gate_up_error(p, quantized_x, align) -> float:
    """GEMM1 of problem p on FP8 activations, against the dequantized operands in float64."""
    (x, x_scale), top_k = quantized_x, p.topk_ids.shape[1]
    gate_up = _poisoned_output(x.shape[0] * top_k, p.w13.shape[1], align["config"])
    invoke_grouped_gemm(x, x_scale, p.w13, p.w13_scale, gate_up, None, a_row_divisor=top_k, **align)
    x_exact = dequantize_activation(x, x_scale, p.quant, torch.float64).repeat_interleave(top_k, dim=0)
    w13 = dequantize_weight(p.w13, p.w13_scale, p.quant, torch.float64)[p.topk_ids.reshape(-1).long()]
    return relative_error(gate_up, torch.einsum("ph,pnh->pn", x_exact, w13))


def _poisoned_output(rows, cols, config):
    """C filled with NaN, so unwritten rows show; split-K adds into zeros, so it gets those."""
    out = gemm_output(rows, cols, torch.float32, config, "cpu")
    return out if config.get("SPLIT_K", 1) > 1 else out.fill_(float("nan"))


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 1, 4, 16), (37, 3, 8, 16), (64, 8, 256, 16)])
def test_align_groups_pairs_by_expert(tokens, top_k, experts, block_m):
    topk_ids = torch.rand(tokens, experts).argsort(dim=1)[:, :top_k].int()
    assert_valid_alignment(topk_ids, block_m, experts, *moe_align_block_size(topk_ids, block_m, experts))


def test_silu_and_mul():
    gate_up = torch.randn(7, 2 * 1500)
    expected = F.silu(gate_up[:, :1500]) * gate_up[:, 1500:]
    torch.testing.assert_close(silu_and_mul(gate_up), expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fuse_silu_mul", [False, True])
def test_quantization_scales(mode, fuse_silu_mul):
    """The scales (fp32 arithmetic, right in the interpreter); fp8 values are checked on the GPU."""
    x = torch.randn(5, 2 * 300) * torch.logspace(-2, 2, 5).unsqueeze(1)
    _, scale = quantize_fp8(x, MODES[mode], fuse_silu_mul=fuse_silu_mul)
    values = F.silu(x[:, :300]) * x[:, 300:] if fuse_silu_mul else x
    _, expected = quantize_activation(values, MODES[mode])
    torch.testing.assert_close(scale, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
@pytest.mark.parametrize("shape", [(300, 520), (256, 384), (5, 7)])
def test_weight_quantization_scales_match_the_cpu_backend(scheme, shape):
    """The GPU backend's amax and scales equal the CPU's bit for bit (fp8 values: on the GPU)."""
    from quantize_moe.quantization import cuda
    from quantize_moe.quantization import fp8
    from quantize_moe.quantization.schemes import SCHEMES

    w = torch.randn(*shape) * torch.logspace(-3, 1, shape[0])[:, None]
    w[1] = 0  # an all-zero row or block gets scale 1
    cell = SCHEMES[scheme].cell(shape)
    out = torch.empty(shape, dtype=fp8.FP8_DTYPE)
    assert torch.equal(cuda.grid_amax(w, cell, "w"), fp8.grid_amax(w, cell, "w"))
    assert torch.equal(cuda.quantize_cells(w, cell, out, "w"), fp8.quantize_cells(w, cell, out, "w"))
