"""Collectives of expert parallelism beyond ParallelContext's own: tensors whose row count
differs per rank (DP attention's batches, the all-to-all's per-rank shares). Each takes the
context and is the identity (or a local copy) with one rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ketch.parallel.context import ParallelContext


def rows_per_rank(parallel: ParallelContext, rows: int, device: torch.device) -> list[int]:
    """Every rank's `rows`, in rank order."""
    if parallel.world_size == 1:
        return [rows]
    t = torch.tensor([rows], dtype=torch.int64, device=device)
    return [int(n) for n in parallel.all_gather(t, dim=0).tolist()]


def all_gather_rows(parallel: ParallelContext, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The ranks' x [counts[r], ...] stacked in rank order (padded to the largest for the
    collective, the padding dropped)."""
    most = max(counts)
    if parallel.world_size == 1 or most == 0:  # every rank idle (DP attention): nothing to gather
        return x
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = parallel.all_gather(padded, dim=0).split(most)
    return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])


def all_to_all_rows(parallel: ParallelContext, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """x's rows in runs of send[r] go to rank r; returns the runs of recv[r] rows from rank r,
    in rank order (torch.distributed.all_to_all_single)."""
    if parallel.world_size == 1:
        return x.clone()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                           group=parallel._group())
    return out


def exchange_counts(parallel: ParallelContext, send: list[int], device: torch.device) -> list[int]:
    """How many rows each rank will send this rank, given how many this rank sends each."""
    if parallel.world_size == 1:
        return list(send)
    t = torch.tensor(send, dtype=torch.int64, device=device)
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=parallel._group())
    return [int(n) for n in out.tolist()]
