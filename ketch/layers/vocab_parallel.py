"""Vocabulary-parallel embedding and LM head: the vocab rows split over ranks.

Each rank holds ceil(vocab / tp) rows (the last rank's share zero-padded), so any vocabulary
size splits. The embedding looks up the ids its rank holds, writes zeros for the others, and
the all-reduce sums each token's one real row (x + 0 is exact). The LM head computes the logits
of its rows and all-gathers them along the vocab, trimming the padding. With TP=1 both are
exactly the unsharded math: `F.embedding`, and the logits product the model used before
(LayerOps.linear when the ops have their own, else torch's GEMM, or `torch.mv` for one bf16 row where
the CPU runner timed it faster at init: `pick_one_row_kernel`).
A tied model uses its embedding as the head (`project`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ketch.layers.parallel_linear import Dense, ShardId
from ketch.layers.sharding import load_shard
from ketch.parallel import SINGLE, ParallelContext


class VocabParallelEmbedding(nn.Module):
    shard_ids: tuple[ShardId, ...] = (None,)
    one_row_mv = True  # one bf16/fp16 row: torch.mv (else the 1-row GEMM); `pick_one_row_kernel`

    def __init__(self, num_embeddings: int, embedding_dim: int, *, parallel: ParallelContext = SINGLE,
                 dense: Dense | None = None) -> None:
        """dense: the logits' product when this is (or is tied to) the LM head; None: torch's."""
        super().__init__()
        self.vocab_size = num_embeddings
        self.parallel = parallel
        self.dense = dense
        per_rank = -(-num_embeddings // parallel.world_size)
        self.start = min(num_embeddings, parallel.rank * per_rank)
        self.end = min(num_embeddings, self.start + per_rank)
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        rows = self.end - self.start
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {(self.vocab_size, *param.shape[1:])}")
        load_shard(param.data[:rows], loaded[self.start : self.end], SINGLE, None)
        param.data[rows:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        x = F.embedding((ids - self.start).masked_fill(~mine, 0), self.weight)
        return self.parallel.all_reduce(x.masked_fill_(~mine.unsqueeze(-1), 0))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the whole vocabulary, [rows, vocab], from hidden [rows, dim]."""
        weight = self.weight
        if self.dense is not None:
            logits = self.dense(hidden, weight, None).float()  # small steps: the skinny GEMM
        elif self.one_row_mv and hidden.shape[0] == 1 and hidden.dtype != torch.float32:
            # one row in bf16/fp16: the matrix-vector kernel streamed the vocab matrix ~1.8x faster
            # than a 1-row GEMM on Sapphire Rapids, ~1.8x slower on a no-AMX Xeon
            # (`pick_one_row_kernel`); fp32 keeps the reference GEMM so parity stays exact
            logits = torch.mv(weight, hidden[0]).float()[None]
        else:
            logits = (hidden @ weight.t()).float()
        if self.parallel.world_size == 1:
            return logits
        return self.parallel.all_gather(logits, dim=-1)[:, : self.vocab_size]

    def pick_one_row_kernel(self, rounds: int = 3) -> bool:
        """Time one bf16/fp16 row through `torch.mv` and the 1-row GEMM on this machine's own
        weight (alternated, best of `rounds`); keep the faster for `project`. Called once at init
        by the CPU runner; returns `one_row_mv`."""
        import time

        x = torch.zeros(1, self.weight.shape[1], dtype=self.weight.dtype, device=self.weight.device)
        best = {True: float("inf"), False: float("inf")}
        for _ in range(rounds):
            for mv in (True, False):
                t0 = time.perf_counter()
                torch.mv(self.weight, x[0]) if mv else x @ self.weight.t()
                best[mv] = min(best[mv], time.perf_counter() - t0)
        self.one_row_mv = best[True] <= best[False]
        return self.one_row_mv


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same vocab split; calling it gives the logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.project(hidden)
