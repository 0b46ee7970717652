"""The fused-MoE layer on GPU: one grouped-GEMM Triton kernel, launched twice.

    out[t] = sum_k  w[t,k] * W2[e] @ (SiLU(W1[e] @ x[t]) * (W3[e] @ x[t])),   e = topk_ids[t, k]

`fused_experts` runs: align (group pairs by expert) -> GEMM1 (x @ w13^T,
gate and up at once) -> SiLU·mul (fused with FP8 activation quantization when
the weights are FP8) -> GEMM2 (h @ w2^T, router weight multiplied in) -> sum
over the top-k.

Tiling of the grouped GEMM
--------------------------
Each launch computes C[p, :] = A[row(p), :] @ B[e(p)]^T for every (token, k)
pair p, where B is the stack of expert weights [E, N, K]. After
`moe_align_block_size`, `sorted_token_ids` lists the pairs expert by expert,
each expert's run padded to a multiple of BLOCK_SIZE_M. So the M axis is cut
into blocks of BLOCK_SIZE_M pairs that share one expert, and the problem is an
ordinary blocked matmul whose A rows are gathered and whose B depends on the
block, as in Triton's matmul tutorial:

    for each program (pid_m, pid_n):                     # one C tile [BLOCK_M, BLOCK_N]
        pairs = sorted_token_ids[pid_m*BM : (pid_m+1)*BM]  # padding = sentinel, masked
        e     = expert_ids[pid_m]
        acc   = 0                                          # fp32 [BLOCK_M, BLOCK_N]
        for k0 in range(0, K, BLOCK_K):
            a = A[row(pairs), k0:k0+BK]                    # gathered [BM, BK]
            b = B[e, n-tile, k0:k0+BK]^T                   # [BK, BN]
            acc += a @ b                                   # tl.dot on tensor cores
        C[pairs, n-tile] = acc * scales * router weight

row(p) is p // top_k for GEMM1 (A is the token's hidden state) and p for
GEMM2 (A is that pair's intermediate activation). Programs are ordered in
groups of GROUP_SIZE_M M-blocks (the tutorial's "grouped ordering") so that
programs running together share B tiles in L2. The grid has the worst-case
number of M-blocks so that no host sync is needed; blocks at or past
num_tokens_post_padded exit at once.

FP8 scales: per-tensor and per-channel weight scales and per-token or
per-tensor activation scales factor out of the K sum, so they are applied
once after the loop. 128x128 block scales change every K step, so each step's
partial product is scaled before it is added (BLOCK_SIZE_K must divide bk).

FP8 accumulation: outside block mode, the K loop accumulates with
`tl.dot(a, b, acc)` and Triton's default `max_num_imprecise_acc`, which on
Hopper lets the tensor cores accumulate the whole loop in their reduced-
precision fp8 accumulator (fast; ~1e-3 relative error, far below the FP8
rounding itself). Block mode adds each step's dot to acc in fp32, so it is
promoted every BLOCK_SIZE_K.
"""

import torch
import triton
import triton.language as tl

from quantize_moe.kernels.align import moe_align_block_size
from quantize_moe.kernels.configs import get_config
from quantize_moe.kernels.quant import quantize_fp8
from quantize_moe.kernels.activation import silu_and_mul
from quantize_moe.moe.quant_spec import UNQUANTIZED, MoEQuantSpec

# Weight-scale layouts, as constexpr for the kernel.
_SCHEME_CODE = {"none": 0, "tensor": 1, "channel": 2, "block": 3}


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, num_pairs, num_m_blocks,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    group_n, group_k,
    A_ROW_DIVISOR: tl.constexpr,       # top_k for GEMM1 (rows are tokens), 1 for GEMM2
    WEIGHT_SCHEME: tl.constexpr,       # 0 none, 1 tensor, 2 channel, 3 block
    PER_ROW_A_SCALE: tl.constexpr,     # a scale per row (token/group) or one scalar
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    # Grouped ordering: walk GROUP_SIZE_M M-blocks down a column of N-tiles before moving right.
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_SIZE_N)
    programs_per_group = GROUP_SIZE_M * num_n_blocks
    first_m = (pid // programs_per_group) * GROUP_SIZE_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_SIZE_M)
    pid_m = first_m + (pid % programs_per_group) % group_rows
    pid_n = (pid % programs_per_group) // group_rows

    if pid_m * BLOCK_SIZE_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_sorted = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
    pairs = tl.load(sorted_token_ids_ptr + offs_sorted).to(tl.int64)
    pair_mask = pairs < num_pairs
    a_rows = pairs // A_ROW_DIVISOR
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    # Columns past N wrap around (always in bounds); the store masks them out.
    offs_n = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk

    if WEIGHT_SCHEME == 3:
        a_scale_ptrs = a_scale_ptr + a_rows * stride_asm
        b_scale_ptrs = b_scale_ptr + expert * stride_bse + (offs_n // group_n) * stride_bsn

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k_step in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_left = K - k_step * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if WEIGHT_SCHEME == 3:
            k_group = (k_step * BLOCK_SIZE_K) // group_k
            a_scale = tl.load(a_scale_ptrs + k_group * stride_ask, mask=pair_mask, other=0.0)
            b_scale = tl.load(b_scale_ptrs + k_group * stride_bsk)
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    if WEIGHT_SCHEME == 1 or WEIGHT_SCHEME == 2:
        if PER_ROW_A_SCALE:
            a_scale = tl.load(a_scale_ptr + a_rows * stride_asm, mask=pair_mask, other=0.0)[:, None]
        else:
            a_scale = tl.load(a_scale_ptr)
        if WEIGHT_SCHEME == 1:
            b_scale = tl.load(b_scale_ptr + expert * stride_bse)
        else:
            b_scale = tl.load(b_scale_ptr + expert * stride_bse + offs_n * stride_bsn)[None, :]
        acc = acc * a_scale * b_scale
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)[:, None]

    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & (offs_cn[None, :] < N))


def _scale_strides(scale: torch.Tensor | None, ndim: int) -> tuple[int, ...]:
    """The first `ndim` strides of a scale tensor, 0 for the dims it lacks (broadcast)."""
    strides = tuple(scale.stride()) if scale is not None else ()
    return (strides + (0,) * ndim)[:ndim]


def invoke_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    a_row_divisor: int,
    quant: MoEQuantSpec,
    config: dict,
) -> None:
    """C[p] = A[p // a_row_divisor] @ B[expert(p)]^T (* scales, * topk_weights[p]) for all pairs p.

    a [M, K]; b [E, N, K]; c [num_pairs, N], written only at real pairs;
    topk_weights (flattened [num_pairs]) is multiplied in when given.
    """
    num_pairs = c.shape[0]
    n, k = b.shape[1], b.shape[2]
    block_m, block_n, block_k = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    group_n, group_k = quant.block_shape or (0, 0)
    if quant.weight == "block" and group_k % block_k:
        raise ValueError(f"BLOCK_SIZE_K={block_k} must divide the quantization group {group_k}")
    num_m_blocks = sorted_token_ids.shape[0] // block_m
    grid = (num_m_blocks * triton.cdiv(n, block_n),)
    _grouped_gemm_kernel[grid](
        a, b, c, a_scale, b_scale, topk_weights,
        sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k, num_pairs, num_m_blocks,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        *_scale_strides(a_scale, 2), *_scale_strides(b_scale, 3),
        group_n, group_k,
        A_ROW_DIVISOR=a_row_divisor,
        WEIGHT_SCHEME=_SCHEME_CODE[quant.weight],
        PER_ROW_A_SCALE=quant.activation != "tensor",
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=block_k,
        GROUP_SIZE_M=config["GROUP_SIZE_M"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    quant: MoEQuantSpec = UNQUANTIZED,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    activation: str = "silu",
    config: dict | None = None,
) -> torch.Tensor:
    """The MoE layer on GPU; [T, H] in hidden_states' dtype.

    hidden_states [T, H] bf16/fp16 (fp32 works too, for the CPU interpreter);
    w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights
    [T, k] float32; topk_ids [T, k] int. FP8 weights come with scales shaped
    as in quant_spec.py; activations are quantized dynamically per `quant`.
    `config` overrides the launch config of both GEMMs (benchmarks, tuning).
    """
    if activation != "silu":
        raise ValueError(f"only 'silu' is supported, not {activation!r}")
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, _ = w13.shape
    num_pairs = num_tokens * top_k
    config = config or get_config(num_tokens, num_experts, two_inter, top_k, quant)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], num_experts)
    gemm = dict(sorted_token_ids=sorted_ids, expert_ids=expert_ids, num_tokens_post_padded=num_post_padded,
                quant=quant, config=config)

    x, x_scale = quantize_fp8(hidden_states, quant) if quant.is_fp8 else (hidden_states, None)
    gate_up = torch.empty(num_pairs, two_inter, dtype=hidden_states.dtype, device=hidden_states.device)
    invoke_grouped_gemm(x, x_scale, w13, w13_scale, gate_up, None, a_row_divisor=top_k, **gemm)

    if quant.is_fp8:
        act, act_scale = quantize_fp8(gate_up, quant, fuse_silu_mul=True)
    else:
        act, act_scale = silu_and_mul(gate_up), None
    out = torch.empty(num_pairs, w2.shape[1], dtype=hidden_states.dtype, device=hidden_states.device)
    invoke_grouped_gemm(act, act_scale, w2, w2_scale, out, topk_weights.reshape(-1).float(), a_row_divisor=1, **gemm)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
