"""moe_align_block_size: group the (token, k) pairs by expert for the grouped GEMM.

The grouped GEMM gives each program BLOCK_M rows that all use one expert's
weights. So the flattened pairs p = token * top_k + k are sorted by expert,
and each expert's run is padded to a multiple of BLOCK_M with the sentinel
T * top_k (a row the GEMM masks out):

    topk_ids (top_k=2, BLOCK_M=4)  [[1, 0], [1, 2], [0, 1]]    pairs 0..5
    sorted_token_ids                [1 5 S S | 0 2 4 S | 3 S S S | S ...]
    expert_ids (one per block)      [0       | 1       | 2       | -1 ...]
    num_tokens_post_padded          [12]

Written with device-side torch ops only (no `.item()`), so that it runs
without a host sync and can be captured in a CUDA graph: the output buffers
have their worst-case size, T*top_k + E*(BLOCK_M-1) rounded up to BLOCK_M,
and blocks past num_tokens_post_padded (expert id -1) are skipped by the GEMM.
"""

import torch


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (sorted_token_ids int32, expert_ids int32, num_tokens_post_padded int32 [1])."""
    device = topk_ids.device
    experts = topk_ids.reshape(-1).long()
    num_pairs = experts.numel()
    max_padded = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m

    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.index_add_(0, experts, torch.ones_like(experts))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    padded_starts = padded_ends - padded_counts
    unpadded_starts = counts.cumsum(0) - counts

    pair_order = torch.sort(experts, stable=True).indices
    sorted_experts = experts[pair_order]
    rank_in_expert = torch.arange(num_pairs, device=device) - unpadded_starts[sorted_experts]
    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids[padded_starts[sorted_experts] + rank_in_expert] = pair_order.to(torch.int32)

    block_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_tokens_post_padded = padded_ends[-1:].to(torch.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded
