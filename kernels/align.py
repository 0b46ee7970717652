"""moe_align_block_size: group the (token, k) pairs by expert for the grouped GEMM.

The grouped GEMM gives each program BLOCK_M rows that all use one expert's
weights. So the flattened pairs p = token * top_k + k are sorted by expert,
and each expert's run is padded to a multiple of BLOCK_M with the sentinel
T * top_k (a row the GEMM masks out):

    topk_ids (top_k=2, BLOCK_M=4)  [[1, 0], [1, 2], [0, 1]]    pairs 0..5
    sorted_token_ids                [1 5 S S | 0 2 4 S | 3 S S S | S ...]
    expert_ids (one per block)      [0       | 1       | 2       | -1 ...]
    num_tokens_post_padded          [12]

One Triton program does it all, so the step costs one launch (plus a tiny
scratch allocation) instead of the dozen-odd small launches of a torch
version, which dominate the layer's time at decode sizes. It needs no host
sync, so it can be captured in a CUDA graph: the outputs have their
worst-case size, T*top_k + E*(BLOCK_M-1) rounded up to BLOCK_M, and blocks
past num_tokens_post_padded (expert id -1) are skipped by the GEMM.

The order of pairs inside one expert's run depends on atomic ordering; the
GEMM computes every row independently, so results do not.
"""

import torch
import triton
import triton.language as tl

_CHUNK = 1024  # pairs handled per loop step
_BLOCKS_CHUNK = 16  # M-blocks labelled per loop step ([16, E] comparison)


@triton.jit
def _align_kernel(
    topk_ids_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr, cursor_ptr,
    num_pairs, num_experts, max_padded,
    BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr,
):
    # 1. Pairs per expert. Masked-out lanes land in the last bin, which is no expert.
    bins = tl.arange(0, NUM_BINS)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=NUM_BINS - 1)
        counts += tl.histogram(ids, NUM_BINS)
    is_expert = bins < num_experts
    padded = tl.where(is_expert, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_tokens_post_padded_ptr, total)
    tl.store(cursor_ptr + bins, ends - padded, mask=is_expert)  # next free slot of each expert

    # 2. Expert of each M-block: the number of expert runs that end at or before its start.
    for first in range(0, max_padded // BLOCK_M, BLOCKS_CHUNK):
        blocks = first + tl.arange(0, BLOCKS_CHUNK)
        block_start = blocks * BLOCK_M
        ended = (ends[None, :] <= block_start[:, None]) & is_expert[None, :]
        expert = tl.where(block_start < total, tl.sum(ended.to(tl.int32), axis=1), -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=block_start < max_padded)

    # 3. Sentinel everywhere, then each pair into its expert's next free slot.
    for start in range(0, max_padded, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_token_ids_ptr + offs, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=offs < max_padded)
    tl.debug_barrier()  # the cursor and sentinel stores are visible to every thread before the scatter
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < num_pairs
        ids = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
        slot = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
        tl.store(sorted_token_ids_ptr + slot, offs, mask=mask)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (sorted_token_ids int32, expert_ids int32, num_tokens_post_padded int32 [1])."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    max_padded = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_token_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_tokens_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    _align_kernel[(1,)](
        topk_ids.reshape(-1).to(torch.int32), sorted_token_ids, expert_ids, num_tokens_post_padded, cursor,
        num_pairs, num_experts, max_padded,
        BLOCK_M=block_m, NUM_BINS=triton.next_power_of_2(num_experts + 1),
        CHUNK=_CHUNK, BLOCKS_CHUNK=_BLOCKS_CHUNK, num_warps=8,
    )
    return sorted_token_ids, expert_ids, num_tokens_post_padded
