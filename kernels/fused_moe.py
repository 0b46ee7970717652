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
GEMM2 (A is that pair's intermediate activation). Tiles are ordered in
groups of GROUP_SIZE_M M-blocks (the tutorial's "grouped ordering") so that
programs running together share B tiles in L2. Only the kernel knows how many
M-blocks hold pairs (num_tokens_post_padded, from the align step), so the grid
is sized for the worst case without a host sync, and programs whose M-block
lies past the real ones exit at once.

Persistent grid: with PERSISTENT, one program per SM walks the tiles of the
real M-blocks (tile, tile + #programs, ...) instead of one program per tile,
and the tile loop is flattened with the K loop (`tl.range(flatten=True)`), so
that the pipeline loads the next tile's first K steps while this tile's
epilogue scales and stores it. A compute-bound GEMM whose tiles take a whole
SM's shared memory otherwise leaves the tensor cores idle during every
epilogue and pipeline fill. One-tile grids keep a straight-line kernel: run
through the same loop (at most once) they measured up to 25% slower.

FP8 scales: per-tensor and per-channel weight scales and per-token or
per-tensor activation scales factor out of the K sum, so they are applied
once after the loop. 128x128 block scales change every K step s (BLOCK_SIZE_K
must divide bk): C = sum_s scale_s * dot_s. Two ways to add that up, which
the tuner picks between per config (RESCALE_ACC):

  * each step's product lands in a second register tile and is scaled there
    before it is added to acc. The next step's dot does not wait for that, so
    tensor cores and scaling overlap; but the two tiles double the registers;
  * the accumulator is kept in units of the current step's scale,

        acc_s = acc_{s-1} * (scale_{s-1} / scale_s) + dot_s,     C = acc_last * scale_last,

    so the tensor cores add each step's product into acc themselves: one
    tile of registers, but each step waits for the last. Scales are clamped
    to MIN_BLOCK_SCALE so that a zero scale (an all-zero block) cannot make
    the ratio infinite; acc stays below C / MIN_BLOCK_SCALE, far from
    float32's range.

Which is faster depends on the tile; the tuner times both.

Split-K: with SPLIT_K > 1 the grid gets a second axis and each program runs
one SPLIT_K-th of the K loop, adding its partial tile into a zeroed float32 C
with atomics (scales and the router weight are linear, so each partial is
scaled before it is added). It multiplies the programs of a decode-size GEMM,
whose few M-blocks would otherwise leave most SMs without weights to stream.
The order of the atomic adds varies, so split-K results vary in the last bits.

TMA: with TMA_B the weight tiles come through Hopper's tensor memory
accelerator (one descriptor over B as [E*N, K] rows) instead of per-thread
pointer loads; A's rows are gathered, so A stays on pointers.

Scalar block scales: when BLOCK_SIZE_N divides the group's bn, a whole
N-tile shares one weight scale per K step, so the in-loop scaling is one
scalar times the per-row activation scale.

Each GEMM has its own launch config (configs.py); the two share BLOCK_SIZE_M
because one align step pads the expert runs for both.

FP8 accumulation: the K loop accumulates with `tl.dot(a, b_tile, acc)` and
Triton's default `max_num_imprecise_acc`, which on Hopper lets the tensor cores
accumulate in their reduced-precision fp8 accumulator (fast; ~1e-3 relative
error, far below the FP8 rounding itself).
"""

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from quantize_moe.kernels.align import moe_align_block_size
from quantize_moe.kernels.configs import get_config, per_gemm
from quantize_moe.kernels.quant import quantize_fp8
from quantize_moe.kernels.activation import silu_and_mul
from quantize_moe.quantization.spec import UNQUANTIZED, MoEQuantSpec

# Weight-scale layouts, as constexpr for the kernel.
_SCHEME_CODE = {"none": 0, "tensor": 1, "channel": 2, "block": 3}
MIN_BLOCK_SCALE = tl.constexpr(1e-30)  # block scales are clamped to this (see the module docstring)


@triton.jit
def _block_scales(a_scale_ptrs, b_scale_ptrs, k_step, pair_mask, stride_ask, stride_bsk, group_k,
                  BLOCK_SIZE_K: tl.constexpr):
    """The activation scales (one per row) and weight scale(s) (one, or one per column) of K step k_step."""
    k_group = (k_step * BLOCK_SIZE_K) // group_k
    a_scale = tl.load(a_scale_ptrs + k_group * stride_ask, mask=pair_mask, other=1.0)
    b_scale = tl.load(b_scale_ptrs + k_group * stride_bsk)
    return tl.maximum(a_scale, MIN_BLOCK_SCALE), tl.maximum(b_scale, MIN_BLOCK_SCALE)


@triton.jit
def _outer(row_factor, column_factor, SCALAR_COLUMN: tl.constexpr):
    """row x column factors as a [BLOCK_M, 1] or [BLOCK_M, BLOCK_N] multiplier of a tile."""
    if SCALAR_COLUMN:
        return (row_factor * column_factor)[:, None]
    return row_factor[:, None] * column_factor[None, :]


@triton.jit
def _tile_position(tile, num_m_blocks, N, BLOCK_SIZE_N: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    """(M-block, N-tile) of a tile number, in grouped ordering: GROUP_SIZE_M M-blocks down a column
    of N-tiles before moving right."""
    tiles_per_group = GROUP_SIZE_M * tl.cdiv(N, BLOCK_SIZE_N)
    first_m = (tile // tiles_per_group) * GROUP_SIZE_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_SIZE_M)
    return first_m + (tile % tiles_per_group) % group_rows, (tile % tiles_per_group) // group_rows


@triton.jit
def _gemm_tile(
    pid_m, pid_n, tensors, sizes, strides,
    WEIGHT_SCHEME: tl.constexpr, PER_ROW_A_SCALE: tl.constexpr, SCALAR_B_SCALE: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr, SPLIT_K: tl.constexpr, TMA_B: tl.constexpr, RESCALE_ACC: tl.constexpr,
):
    """One C tile: its K loop (or this program's split of it), scales, router weight and store."""
    a_ptr, b, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr = tensors
    N, K, num_pairs, group_n, group_k, a_row_divisor = sizes
    (stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
     stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk) = strides

    offs_sorted = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
    pairs = tl.load(sorted_token_ids_ptr + offs_sorted).to(tl.int64)
    pair_mask = pairs < num_pairs
    a_rows = pairs // a_row_divisor
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    # This program's share of the K loop (all of it without split-K).
    num_k_steps = tl.cdiv(K, BLOCK_SIZE_K)
    steps_per_split = tl.cdiv(num_k_steps, SPLIT_K)
    first_step = tl.program_id(1) * steps_per_split
    last_step = tl.minimum(first_step + steps_per_split, num_k_steps)

    # Columns past N wrap around (always in bounds); the store masks them out. (TMA loads instead read
    # the next expert's rows, or zeros past the last: masked out the same way.)
    offs_n = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    first_k = first_step * BLOCK_SIZE_K
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + (first_k + offs_k[None, :]) * stride_ak
    if TMA_B:
        b_row = (expert * N + pid_n * BLOCK_SIZE_N).to(tl.int32)
    else:
        b_ptrs = (b + expert * stride_be + offs_n[None, :] * stride_bn
                  + (first_k + offs_k[:, None]) * stride_bk)

    if WEIGHT_SCHEME == 3:
        a_scale_ptrs = a_scale_ptr + a_rows * stride_asm
        if SCALAR_B_SCALE:
            b_scale_ptrs = (b_scale_ptr + expert * stride_bse
                            + (pid_n * BLOCK_SIZE_N // group_n) * stride_bsn)
        else:
            b_scale_ptrs = b_scale_ptr + expert * stride_bse + (offs_n // group_n) * stride_bsn

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if WEIGHT_SCHEME == 3 and RESCALE_ACC:  # the scales acc is in units of (its first step's: any would do for 0)
        last_a_scale, last_b_scale = _block_scales(a_scale_ptrs, b_scale_ptrs,
                                                   tl.minimum(first_step, num_k_steps - 1), pair_mask,
                                                   stride_ask, stride_bsk, group_k, BLOCK_SIZE_K)
    for k_step in range(first_step, last_step):
        k_left = K - k_step * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        if TMA_B:
            b_tile = b.load([b_row, k_step * BLOCK_SIZE_K]).T
        else:
            b_tile = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            b_ptrs += BLOCK_SIZE_K * stride_bk
        if WEIGHT_SCHEME == 3:
            a_scale, b_scale = _block_scales(a_scale_ptrs, b_scale_ptrs, k_step, pair_mask, stride_ask,
                                             stride_bsk, group_k, BLOCK_SIZE_K)
        if WEIGHT_SCHEME == 3 and not RESCALE_ACC:  # this step's product scaled, then added
            acc += tl.dot(a, b_tile) * _outer(a_scale, b_scale, SCALAR_B_SCALE)
        else:
            if WEIGHT_SCHEME == 3:  # acc into units of this step's scale (see the docstring)
                acc = acc * _outer(last_a_scale / a_scale, last_b_scale / b_scale, SCALAR_B_SCALE)
                last_a_scale, last_b_scale = a_scale, b_scale
            acc = tl.dot(a, b_tile, acc)
        a_ptrs += BLOCK_SIZE_K * stride_ak

    if WEIGHT_SCHEME == 3 and RESCALE_ACC:
        acc = acc * _outer(last_a_scale, last_b_scale, SCALAR_B_SCALE)
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
    c_mask = pair_mask[:, None] & (offs_cn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:
        tl.atomic_add(c_ptrs, acc, mask=c_mask, sem="relaxed")


# Arguments that vary with the token count or only feed index arithmetic: not specialized,
# so one compiled kernel serves every batch size and every model's scale layout.
_RUNTIME_ONLY = ["num_pairs", "num_m_blocks", "a_row_divisor", "stride_asm", "stride_ask",
                 "stride_bse", "stride_bsn", "stride_bsk", "group_n", "group_k"]


@triton.jit(do_not_specialize=_RUNTIME_ONLY)
def _grouped_gemm_kernel(
    a_ptr, b, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, num_pairs, num_m_blocks,     # num_m_blocks: the worst case, for a grid sized without a host sync
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    group_n, group_k,
    a_row_divisor,                     # top_k for GEMM1 (rows are tokens), 1 for GEMM2
    WEIGHT_SCHEME: tl.constexpr,       # 0 none, 1 tensor, 2 channel, 3 block
    PER_ROW_A_SCALE: tl.constexpr,     # a scale per row (token/group) or one scalar
    SCALAR_B_SCALE: tl.constexpr,      # block scales: one weight scale per (N-tile, K step)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, SPLIT_K: tl.constexpr,
    TMA_B: tl.constexpr,               # b is a tensor descriptor of B as [E*N, K], else a pointer
    RESCALE_ACC: tl.constexpr,         # block scales: acc kept in units of the step's scale (docstring)
    PERSISTENT: tl.constexpr,          # one program per SM walks the tiles (docstring), else one per tile
):
    tensors = (a_ptr, b, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr)
    sizes = (N, K, num_pairs, group_n, group_k, a_row_divisor)
    strides = (stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
               stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk)
    if PERSISTENT:
        # Walk the tiles of the M-blocks that hold pairs, in a loop flattened with the K loop.
        num_m_blocks = tl.load(num_tokens_post_padded_ptr) // BLOCK_SIZE_M
        for tile in tl.range(tl.program_id(0), num_m_blocks * tl.cdiv(N, BLOCK_SIZE_N), tl.num_programs(0),
                             flatten=True):
            pid_m, pid_n = _tile_position(tile, num_m_blocks, N, BLOCK_SIZE_N, GROUP_SIZE_M)
            _gemm_tile(pid_m, pid_n, tensors, sizes, strides, WEIGHT_SCHEME, PER_ROW_A_SCALE, SCALAR_B_SCALE,
                       MUL_ROUTED_WEIGHT, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, SPLIT_K, TMA_B, RESCALE_ACC)
    else:
        # One tile per program; M-blocks at or past num_tokens_post_padded hold no pairs.
        pid_m, pid_n = _tile_position(tl.program_id(0), num_m_blocks, N, BLOCK_SIZE_N, GROUP_SIZE_M)
        if pid_m * BLOCK_SIZE_M < tl.load(num_tokens_post_padded_ptr):
            _gemm_tile(pid_m, pid_n, tensors, sizes, strides, WEIGHT_SCHEME, PER_ROW_A_SCALE, SCALAR_B_SCALE,
                       MUL_ROUTED_WEIGHT, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, SPLIT_K, TMA_B, RESCALE_ACC)


def _scale_strides(scale: torch.Tensor | None, ndim: int) -> tuple[int, ...]:
    """The first `ndim` strides of a scale tensor, 0 for the dims it lacks (broadcast)."""
    strides = tuple(scale.stride()) if scale is not None else ()
    return (strides + (0,) * ndim)[:ndim]


def _weight_descriptor(b: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """B [E, N, K] as one TMA descriptor over [E*N, K] rows, loading [BLOCK_N, BLOCK_K] tiles."""
    num_experts, n, k = b.shape
    if not b.is_contiguous() or (k * b.element_size()) % 16:
        raise ValueError(f"TMA_B needs contiguous expert weights with 16-byte rows, not {tuple(b.shape)} {b.dtype}")
    return TensorDescriptor(b, shape=[num_experts * n, k], strides=[k, 1], block_shape=[block_n, block_k])


@functools.cache
def _program_slots(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (on the CPU interpreter, a few, so that each walks
    several tiles)."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemm_output(num_pairs: int, n: int, dtype: torch.dtype, config: dict, device) -> torch.Tensor:
    """The C buffer of one grouped GEMM: split-K adds partial tiles into zeroed float32."""
    if config.get("SPLIT_K", 1) > 1:
        return torch.zeros(num_pairs, n, dtype=torch.float32, device=device)
    return torch.empty(num_pairs, n, dtype=dtype, device=device)


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
    warmup: bool = False,
) -> None:
    """C[p] = A[p // a_row_divisor] @ B[expert(p)]^T (* scales, * topk_weights[p]) for all pairs p.

    a [M, K]; b [E, N, K]; c [num_pairs, N] from `gemm_output`, written only at
    real pairs; topk_weights (flattened [num_pairs]) is multiplied in when given.
    With warmup, only compile the kernel (any tensor may be on the meta device).
    """
    num_pairs = c.shape[0]
    n, k = b.shape[1], b.shape[2]
    block_m, block_n, block_k = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    split_k = config.get("SPLIT_K", 1)
    group_n, group_k = quant.block_shape or (0, 0)
    if quant.weight == "block" and group_k % block_k:
        raise ValueError(f"BLOCK_SIZE_K={block_k} must divide the quantization group {group_k}")
    if split_k > 1 and c.dtype != torch.float32:
        raise ValueError("with SPLIT_K > 1 the GEMM adds into C: it must be zeroed float32 (gemm_output)")
    num_m_blocks = sorted_token_ids.shape[0] // block_m  # the worst case: no host sync
    tiles = num_m_blocks * triton.cdiv(n, block_n)
    persistent = config.get("PERSISTENT", False)
    grid = (min(tiles, _program_slots(a.device)) if persistent else tiles, split_k)
    launch = functools.partial(_grouped_gemm_kernel.warmup, grid=grid) if warmup else _grouped_gemm_kernel[grid]
    tma_b = config.get("TMA_B", False)
    launch(
        a, _weight_descriptor(b, block_n, block_k) if tma_b else b, c, a_scale, b_scale, topk_weights,
        sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k, num_pairs, num_m_blocks,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        *_scale_strides(a_scale, 2), *_scale_strides(b_scale, 3),
        group_n, group_k, a_row_divisor,
        WEIGHT_SCHEME=_SCHEME_CODE[quant.weight],
        PER_ROW_A_SCALE=quant.activation not in ("tensor", "static"),
        SCALAR_B_SCALE=quant.weight == "block" and group_n % block_n == 0,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=block_k,
        GROUP_SIZE_M=config["GROUP_SIZE_M"], SPLIT_K=split_k, TMA_B=tma_b,
        RESCALE_ACC=quant.weight == "block" and config.get("RESCALE_ACC", False), PERSISTENT=persistent,
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
    a13_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    activation: str = "silu",
    config: dict | None = None,
) -> torch.Tensor:
    """The MoE layer on GPU; [T, H] in hidden_states' dtype.

    hidden_states [T, H] bf16/fp16 (fp32 works too, for the CPU interpreter);
    w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights
    [T, k] float32; topk_ids [T, k] int. FP8 weights come with scales shaped
    as in quant_spec.py; activations are quantized dynamically per `quant`, or
    with the static scales a13_scale / a2_scale [1] of static checkpoints.
    `config` overrides the launch configs (benchmarks, tuning): one config for
    both GEMMs or a {"gemm1": ..., "gemm2": ...} table entry (configs.py).
    """
    if activation != "silu":
        raise ValueError(f"only 'silu' is supported, not {activation!r}")
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, _ = w13.shape
    num_pairs = num_tokens * top_k
    dtype, device = hidden_states.dtype, hidden_states.device
    config1, config2 = per_gemm(config) if config else get_config(num_tokens, num_experts, two_inter, top_k, quant)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids, config1["BLOCK_SIZE_M"], num_experts)
    routing = dict(sorted_token_ids=sorted_ids, expert_ids=expert_ids, num_tokens_post_padded=num_post_padded,
                   quant=quant)

    x, x_scale = quantize_fp8(hidden_states, quant, static_scale=a13_scale) if quant.is_fp8 else (hidden_states, None)
    gate_up = gemm_output(num_pairs, two_inter, dtype, config1, device)
    invoke_grouped_gemm(x, x_scale, w13, w13_scale, gate_up, None, a_row_divisor=top_k, config=config1, **routing)

    if quant.is_fp8:
        act, act_scale = quantize_fp8(gate_up, quant, fuse_silu_mul=True, static_scale=a2_scale)
    else:
        act, act_scale = silu_and_mul(gate_up, dtype), None
    out = gemm_output(num_pairs, w2.shape[1], dtype, config2, device)
    invoke_grouped_gemm(act, act_scale, w2, w2_scale, out, topk_weights.reshape(-1).float(), a_row_divisor=1,
                        config=config2, **routing)
    return out.view(num_tokens, top_k, -1).sum(dim=1).to(dtype)
