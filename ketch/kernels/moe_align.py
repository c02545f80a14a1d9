"""Token -> expert sorting with block padding, the input of the grouped MoE GEMM (fused_moe.py).

The T tokens' k picks are T * k rows, named by their flat index `t * k + slot` (< T * k). They
are grouped by expert (tokens in order inside an expert: a stable sort) and each expert's run is
padded to a multiple of BLOCK_M with the sentinel T * k, so that every BLOCK_M-row block of the
result belongs to one expert:

    sorted_token_ids  [max_padded] int32   row ids by expert, sentinel-padded; entries past
                                           num_tokens_post_padded are sentinels too
    expert_ids        [max_padded / BLOCK_M] int32   the expert of each block; -1 past the end
    num_tokens_post_padded [1] int32      rows in use (a multiple of BLOCK_M)

max_padded = T * k + min(E, T * k) * (BLOCK_M - 1) rounded up to a multiple of BLOCK_M: at
most min(E, T * k) experts have rows, each pads fewer than BLOCK_M. It depends on the shapes only, so the GEMM's grid does too (CUDA
graphs); blocks past num_tokens_post_padded exit at once on the device.

Torch, not Triton: about ten small device ops (scatter_add for the counts, cumsum, a stable
argsort, a scatter, searchsorted), none of which reads back to the host (no bincount, whose
CUDA version syncs for its size; no nonzero, no .item()). The cost is launches, a few µs each,
captured in the decode graphs; a one-kernel Triton version is the follow-up if the H200 run
shows it matters next to the GEMMs. The torch code runs unchanged on the CPU (tests).
"""
from __future__ import annotations

import torch


def max_padded_rows(rows: int, num_experts: int, block_m: int) -> int:
    """The bound above, rounded up to whole blocks (the GEMM reads sorted_token_ids by block)."""
    bound = rows + min(num_experts, rows) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (any integer type, values in [0, num_experts)) -> (sorted_token_ids,
    expert_ids, num_tokens_post_padded) as described above. No host sync."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    rows = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # each expert's padded run ends here
    starts = ends - padded
    first = counts.cumsum(0) - counts  # where each expert's rows start in the unpadded sort
    order = flat.argsort(stable=True)  # row ids grouped by expert, in row order inside each
    expert_of = flat[order]
    dest = starts[expert_of] + torch.arange(rows, device=device) - first[expert_of]
    total = max_padded_rows(rows, num_experts, block_m)
    sorted_ids = torch.full((total,), rows, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, total, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)  # first expert whose run ends after
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)
