"""Tensor-parallel linear layers (Megatron's split): each holds its rank's share of the weight
and loads that share itself from the full checkpoint tensor (`weight_loader`).

    ColumnParallelLinear        W's rows (output features) split; y comes out split, nothing
                                is communicated
    MergedColumnParallelLinear  several column-parallel projections of one input stacked
                                (gate|up): each rank holds [gate_r | up_r]
    QKVParallelLinear           q|k|v stacked: each rank holds its q heads and its kv heads
    StackedLinear               projections of one input stacked, each part either split by
                                rows or whole on every rank (DeepSeek's q | kv_a: the query
                                heads are split, the latent's down-projection is not)
    RowParallelLinear           W's columns (input features) split; takes the split y of a
                                column-parallel layer, all-reduces the partial products

So attention (q/k/v heads) and the MLP (intermediate features) run rank-locally between one
column- and one row-parallel layer, with one all-reduce each. With TP=1 every layer is exactly
`Linear` (the same fused layout, the same dense or 4-bit product, the bias inside the GEMM).

A layer's `shard_ids` are the checkpoint tensors it is made of (("q", "k", "v"), (0, 1), or
(None,) for one); `weight_loader(param, full, shard_id)` copies this rank's part of one of them
into its slot, `int4_part(q4, shard_id)` slices a 4-bit GGUF weight the same way.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ketch.layers.linear import Linear
from ketch.layers.q4 import Q4Weight
from ketch.layers.sharding import load_range, load_shard, narrow_q4, shard_q4
from ketch.parallel import SINGLE, ParallelContext

ShardId = str | int | None
Dense = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class ColumnParallelLinear(Linear):
    shard_ids: tuple[ShardId, ...] = (None,)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 parallel: ParallelContext = SINGLE, dense: Dense = F.linear, field: str = "out_features") -> None:
        super().__init__(in_features, parallel.split(out_features, field), bias=bias, dense=dense)
        self.parallel = parallel

    def slot(self, shard_id: ShardId) -> tuple[int, int]:
        """(first row, rows) of `shard_id`'s part inside this rank's weight."""
        return 0, self.out_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        offset, rows = self.slot(shard_id)
        load_shard(param.data.narrow(0, offset, rows), loaded, self.parallel, dim=0)

    def int4_part(self, w: Q4Weight, shard_id: ShardId = None) -> Q4Weight | None:
        return shard_q4(w, self.parallel, dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False, *,
                 parallel: ParallelContext = SINGLE, dense: Dense = F.linear, field: str = "output_sizes") -> None:
        self.local_sizes = tuple(parallel.split(n, field) for n in output_sizes)
        super().__init__(in_features, sum(output_sizes), bias, parallel=parallel, dense=dense, field=field)
        self.shard_ids = tuple(range(len(output_sizes)))

    def slot(self, shard_id: ShardId) -> tuple[int, int]:
        assert isinstance(shard_id, int), f"merged projection: shard id {shard_id!r} is not a part index"
        return sum(self.local_sizes[:shard_id]), self.local_sizes[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """Each rank holds its `ParallelContext.head_share`: a contiguous run of kv heads (as even as
    whole GQA groups allow: 3 kv heads over 2 ranks are 2 and 1) and the q heads that attend to them."""

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, *,
                 parallel: ParallelContext = SINGLE, dense: Dense = F.linear) -> None:
        self.share = parallel.head_share(num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads = self.share.num_q, self.share.num_kv  # this rank's
        self.head_dim = head_dim
        self.full_heads = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}
        # not ColumnParallelLinear's even split: the share may be uneven
        Linear.__init__(self, hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias=bias, dense=dense)
        self.parallel = parallel

    def slot(self, shard_id: ShardId) -> tuple[int, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]  # type: ignore[index]

    def source_rows(self, shard_id: ShardId) -> int:
        """First row of this rank's part inside the checkpoint's full q, k or v tensor."""
        return (self.share.q_start if shard_id == "q" else self.share.kv_start) * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        offset, rows = self.slot(shard_id)
        full = self.full_heads[shard_id] * self.head_dim  # type: ignore[index]
        load_range(param.data.narrow(0, offset, rows), loaded, 0, self.source_rows(shard_id), full)

    def int4_part(self, w: Q4Weight, shard_id: ShardId = None) -> Q4Weight | None:
        return narrow_q4(w, 0, self.source_rows(shard_id), self.slot(shard_id)[1])


class StackedLinear(Linear):
    """Several projections of one input in one product: `split[i]` says whether part i's rows
    are split over the ranks (as ColumnParallelLinear) or whole on each rank (a replicated
    Linear). At batch 1 each product is a separate weight stream with its own launch ramp; one
    stacked product streams the same bytes in one. `parts(y)` cuts the output back into views.
    `biased[i]`: part i's checkpoint has a bias (a part without one keeps zeros in its slot)."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], split: Sequence[bool],
                 biased: Sequence[bool] | None = None, *, parallel: ParallelContext = SINGLE, dense: Dense = F.linear,
                 field: str = "output_sizes") -> None:
        if len(split) != len(output_sizes):
            raise ValueError(f"split: {len(split)} flags for {len(output_sizes)} parts")
        self.local_sizes = tuple(parallel.split(n, field) if s else n for n, s in zip(output_sizes, split))
        self.split, self.biased = tuple(split), tuple(biased or (False,) * len(output_sizes))
        super().__init__(in_features, sum(self.local_sizes), bias=any(self.biased), dense=dense)
        if self.bias is not None:
            self.bias.data.zero_()  # the slots of parts without a bias
        self.parallel = parallel
        self.shard_ids = tuple(range(len(output_sizes)))

    def param_shard_ids(self, param_name: str) -> tuple[int, ...]:
        """The checkpoint tensors each parameter is made of (param_loader's completeness check)."""
        return tuple(i for i in self.shard_ids if param_name == "weight" or self.biased[i])

    def slot(self, shard_id: ShardId) -> tuple[int, int]:
        assert isinstance(shard_id, int), f"stacked projection: shard id {shard_id!r} is not a part index"
        return sum(self.local_sizes[:shard_id]), self.local_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        offset, rows = self.slot(shard_id)
        if param is self.bias and not self.biased[shard_id]:  # type: ignore[index]
            raise ValueError(f"part {shard_id} of this projection has no bias")
        load_shard(param.data.narrow(0, offset, rows), loaded, self.parallel,
                   dim=0 if self.split[shard_id] else None)  # type: ignore[index]

    def parts(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """y [..., sum of this rank's parts] -> one view per part (no copies)."""
        return y.split(self.local_sizes, dim=-1)


class RowParallelLinear(Linear):
    shard_ids: tuple[ShardId, ...] = (None,)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 parallel: ParallelContext = SINGLE, dense: Dense = F.linear, field: str = "in_features",
                 part: tuple[int, int] | None = None) -> None:
        # part: (first input feature, count) of an uneven share (o_proj under a GQA head_share);
        # None: the even split
        self.in_full, self.part = in_features, part
        super().__init__(part[1] if part else parallel.split(in_features, field), out_features, bias=bias, dense=dense)
        self.parallel = parallel
        self.reduce = parallel.world_size > 1  # fixed at build: TP=1 runs plain Linear.forward

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        # the bias is whole on every rank: added once, after the sum
        if param is self.weight and self.part is not None:
            load_range(param.data, loaded, 1, self.part[0], self.in_full)
            return
        load_shard(param.data, loaded, self.parallel, dim=1 if param is self.weight else None)

    def int4_part(self, w: Q4Weight, shard_id: ShardId = None) -> Q4Weight | None:
        if self.part is not None:
            return narrow_q4(w, 1, *self.part)
        return shard_q4(w, self.parallel, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:
            return super().forward(x)
        y = self.parallel.all_reduce(self.project(x, None))
        return y if self.bias is None else y + self.bias
