"""ParallelContext: which tensor-parallel rank this process is, of how many, and the group the
collectives run over.

It is handed to the model's constructor (like `LayerOps`) and from there to every parallel
layer, so two models with different contexts can live in one process (the TP=2 tests run a TP=1
reference beside them). Nothing here is a module-level "current group".

`SINGLE` is TP=1: no group, every collective is the identity and every split is the whole.
A context of world_size > 1 without a group is allowed for planning (shapes, KV bytes per
rank); its collectives raise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ketch.parallel.expert import NO_EP, ExpertParallel


@dataclass(frozen=True)
class HeadShare:
    """A rank's attention heads: a contiguous run of kv heads and the q heads of their groups."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup; None for TP=1 (or shapes-only planning)
    ep: ExpertParallel = NO_EP  # how the MoE layers use these ranks (expert.py)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.ep.size not in (1, self.world_size):
            raise ValueError(f"ep_size: {self.ep.size} must be 1 or the tensor parallel size {self.world_size} "
                             f"(the EP ranks are the TP ranks)")

    @classmethod
    def from_group(cls, group: Any, ep: ExpertParallel = NO_EP) -> ParallelContext:
        """This process's place in an initialized torch.distributed group."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group, ep)

    def for_attention(self) -> ParallelContext:
        """The context of attention, dense MLPs, embedding and LM head: a single rank's (whole
        heads, whole vocabulary) under DP attention, else this one."""
        return SINGLE if self.ep.dp_attention else self

    def split(self, total: int, field: str) -> int:
        """This rank's share of `total` (heads, features, rows); `field` names what is split."""
        if total % self.world_size:
            raise ValueError(f"{field}: {total} does not split evenly over tensor parallel size {self.world_size}")
        return total // self.world_size

    def head_share(self, num_heads: int, num_kv_heads: int) -> HeadShare:
        """This rank's heads. KV heads are split, never replicated, as evenly as whole GQA groups
        allow (SmolLM2's 3 kv heads over 2 ranks: 2 and 1), each rank taking the q heads that
        attend to its kv heads; an even split is `split`'s."""
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: {num_heads} heads do not form groups over {num_kv_heads} kv heads")
        if num_kv_heads < self.world_size:
            raise ValueError(f"num_kv_heads: {num_kv_heads} kv heads cannot give one to each rank of tensor parallel "
                             f"size {self.world_size} (replicating kv heads across ranks is not supported)")
        base, extra = divmod(num_kv_heads, self.world_size)
        kv_start = self.rank * base + min(self.rank, extra)
        num_kv = base + (self.rank < extra)
        group = num_heads // num_kv_heads
        return HeadShare(kv_start * group, num_kv * group, kv_start, num_kv)

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of `full` along `dim` (a view; world_size must divide it)."""
        size = self.split(full.shape[dim], f"tensor dim {dim} of shape {tuple(full.shape)}")
        return full.narrow(dim, self.rank * size, size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self._group())
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self._group())
        return torch.cat(parts, dim=dim)

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (e.g. KV pages: the pool every rank can hold)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)  # nccl reduces GPU tensors only
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group())
        return int(t.item())

    def _group(self) -> Any:
        if self.group is None:
            raise ValueError(f"ParallelContext: world_size {self.world_size} without a process group "
                             f"(a planning context) cannot run collectives")
        return self.group


SINGLE = ParallelContext()  # TP=1, the default of every model and layer
