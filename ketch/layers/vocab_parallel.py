"""Vocabulary-parallel embedding and LM head: the vocab rows split over ranks.

Each rank holds ceil(vocab / tp) rows (the last rank's share zero-padded), so any vocabulary
size splits. The embedding looks up the ids its rank holds, writes zeros for the others, and
the all-reduce sums each token's one real row (x + 0 is exact). The LM head computes the logits
of its rows and all-gathers them along the vocab, trimming the padding. With TP=1 both are
exactly the unsharded math: `F.embedding`, and the logits product the model used before
(LayerOps.linear when the ops have their own, else torch's GEMM). One bf16/fp16 row (CPU decode
at batch 1) takes whichever of three the CPU runner timed fastest at init (`pick_one_row_kernel`):
`torch.mv`, the 1-row GEMM, or an int8 copy of the matrix (half the bytes of bf16, and a batch-1
LM head only streams bytes): where ketch's C kernels build, int8 blocks of 32 with an fp16 scale
each, as GGUF's Q8_0 (ketch/native/q8.py: a Q8_0 head gets its file's values back), else one
scale per vocab row (`torch._weight_int8pack_mm`: 1/254 of the row's largest). A step of several
rows takes ketch's int8 blocks up to as many rows as they timed faster than the GEMM at init,
the GEMM beyond (`pick_many_rows_kernel`): with AMX the GEMM wins from some rows on, but a step
of 2 rows (a draft's catch-up, a verify, two streams) took 4.5 ms in the GEMM against 1.2 for
one int8 row; without native bf16 the GEMM is emulated and int8 wins at every size timed.
fp32 never uses int8.
A tied model uses its embedding as the head (`project`).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ketch.layers.parallel_linear import Dense, ShardId
from ketch.layers.sharding import load_shard
from ketch.native import q8 as native_q8
from ketch.parallel import SINGLE, ParallelContext


INT8_MARGIN = 0.8  # int8 rows must take < 80 % of the faster bf16 kernel's time to be picked
INT8_ROW_SIZES = (2, 4, 8, 16, 32)  # the step sizes `pick_many_rows_kernel` times
UNBOUNDED = 1 << 62  # int8 won at every size timed: it takes every step
_PICKED: dict[tuple, str | int] = {}  # (shape, dtype, device, kernels) -> what this process picked


class VocabParallelEmbedding(nn.Module):
    shard_ids: tuple[ShardId, ...] = (None,)
    one_row_kernel = "mv"  # one bf16/fp16 row: "mv" | "gemm" | "int8"; `pick_one_row_kernel`
    int8_max_rows = 1  # steps of 2..int8_max_rows rows take int8 blocks, larger ones the GEMM
    # "int8" only: ketch's Q8_0-style blocks, or torch's (int8 rows, per-row scales)
    int8: "native_q8.NativeQ8 | tuple[torch.Tensor, torch.Tensor] | None" = None

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
        elif hidden.dtype != torch.float32 and (kernel := self._kernel_for(hidden.shape[0])) != "gemm":
            # one row in bf16/fp16: the matrix-vector kernel streamed the vocab matrix ~1.8x faster
            # than a 1-row GEMM on Sapphire Rapids, ~1.8x slower on a no-AMX Xeon, where int8 rows
            # beat both (`pick_one_row_kernel`); several rows: int8 blocks up to the measured row
            # count; fp32 keeps the reference GEMM so parity stays exact
            logits = self._product(hidden, kernel).float()
        else:
            logits = (hidden @ weight.t()).float()
        if self.parallel.world_size == 1:
            return logits
        return self.parallel.all_gather(logits, dim=-1)[:, : self.vocab_size]

    def _kernel_for(self, rows: int) -> str:
        if rows == 1:
            return self.one_row_kernel
        return "int8" if rows <= self.int8_max_rows else "gemm"

    def _product(self, hidden: torch.Tensor, kernel: str) -> torch.Tensor:
        if kernel == "mv":  # one row only
            return torch.mv(self.weight, hidden[0])[None]
        if kernel == "int8":
            if isinstance(self.int8, native_q8.NativeQ8):
                return self.int8.matmul(hidden)
            q, scales = self.int8
            return torch._weight_int8pack_mm(hidden, q, scales)
        return hidden @ self.weight.t()

    def quantize_int8(self, chunk_rows: int = 8192) -> None:
        """The int8 copy: ketch's blocks where they build for this dtype, else torch's rows."""
        if self.weight.device.type == "cpu" and self.weight.dtype == torch.bfloat16 and native_q8.available():
            self.int8 = native_q8.NativeQ8.quantize(self.weight, chunk_rows)
        else:
            self.int8 = self._int8_rows(chunk_rows)

    def _int8_rows(self, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One scale per row: q = round(w / s), s = max |w| of the row / 127 in the weight's
        dtype (the kernel's), nudged up before rounding (and kept a normal number) so that no q
        passes 127: |q s - w| <= s / 2. In chunks of rows: no fp32 copy of the whole matrix."""
        dtype = self.weight.dtype
        q = torch.empty(self.weight.shape, dtype=torch.int8, device=self.weight.device)
        scales = torch.empty(self.weight.shape[0], dtype=dtype, device=self.weight.device)
        for start in range(0, self.weight.shape[0], chunk_rows):
            w = self.weight[start : start + chunk_rows].float()
            # bf16/fp16 round a normal number by < 2^-8 of it: the nudge keeps s >= amax / 127
            s = (w.abs().amax(dim=1) / 127 * (1 + 2**-7)).clamp_min(torch.finfo(dtype).tiny).to(dtype)
            q[start : start + chunk_rows] = torch.round(w / s.float()[:, None]).clamp_(-127, 127)
            scales[start : start + chunk_rows] = s
        return q, scales

    def pick_one_row_kernel(self, rounds: int = 3, kernels: tuple[str, ...] = ("mv", "gemm", "int8")) -> str:
        """Time one bf16/fp16 row through each kernel on this machine's own weight (alternated,
        best of `rounds`) and keep `choose_one_row_kernel`'s pick for `project` (the int8 copy
        only if it is picked). Called once at init by the CPU runner; returns `one_row_kernel`.
        Once per process and head shape: every later engine of this process takes the same
        kernel, so two engines of one process (an A/B, a test) never differ by a timing."""
        key = (tuple(self.weight.shape), self.weight.dtype, self.weight.device.type, kernels)
        if key not in _PICKED:
            if "int8" in kernels:
                self.quantize_int8()
            x = torch.zeros(1, self.weight.shape[1], dtype=self.weight.dtype, device=self.weight.device)
            _PICKED[key] = choose_one_row_kernel(self._best_times(x, kernels, rounds, self._evictor()))
        self.one_row_kernel = _PICKED[key]
        self._keep_int8_if_used()
        return self.one_row_kernel

    def pick_many_rows_kernel(self, sizes: tuple[int, ...] = INT8_ROW_SIZES, rounds: int = 2) -> int:
        """Time steps of each of `sizes` bf16/fp16 rows through the GEMM and ketch's int8 blocks (only
        those: torch's int8 rows kernel is a batch-1 kernel), the head evicted from the cache before
        each run as in `pick_one_row_kernel`, and keep int8 for steps up to the last size of an
        unbroken run of int8 wins (`int8_rows_crossover`). Once per process and head shape, like
        `pick_one_row_kernel`; call that first (its int8 copy is reused). Returns `int8_max_rows`."""
        key = (tuple(self.weight.shape), self.weight.dtype, self.weight.device.type, "many", sizes)
        if key not in _PICKED:
            _PICKED[key] = 1
            if native_q8.available() and self.weight.device.type == "cpu" and self.weight.dtype == torch.bfloat16:
                if not isinstance(self.int8, native_q8.NativeQ8):
                    self.quantize_int8()
                x = torch.randn(max(sizes), self.weight.shape[1], generator=torch.Generator().manual_seed(0))
                x = x.to(self.weight.dtype)
                evict, won = self._evictor(), []
                for rows in sizes:  # from the smallest: a loss ends the timing (larger steps favour the GEMM)
                    won.append(choose_one_row_kernel(self._best_times(x[:rows], ("gemm", "int8"), rounds,
                                                                      evict)) == "int8")
                    if not won[-1]:
                        break
                _PICKED[key] = int8_rows_crossover(sizes, won)
        self.int8_max_rows = int(_PICKED[key])
        self._keep_int8_if_used()
        return self.int8_max_rows

    def _evictor(self) -> Callable[[], object]:
        """A decode step reads the head after every layer's weights: from memory, not from the cache
        where the kernel timed just before left its bytes (there the int8 copy ran at ~0.75 of mv,
        from memory ~0.5). Reading twice the head's bytes between runs evicts it."""
        return torch.ones(2 * self.weight.numel() * self.weight.element_size() // 4, dtype=torch.float32).sum

    def _best_times(self, x: torch.Tensor, kernels: tuple[str, ...], rounds: int,
                    before_each: Callable[[], object] = lambda: None) -> dict[str, float]:
        """Each kernel's best time over `rounds`, the kernels alternated within a round."""
        best = dict.fromkeys(kernels, float("inf"))
        for _ in range(rounds):
            for kernel in kernels:
                before_each()
                t0 = time.perf_counter()
                self._product(x, kernel)
                best[kernel] = min(best[kernel], time.perf_counter() - t0)
        return best

    def _keep_int8_if_used(self) -> None:
        if self.one_row_kernel != "int8" and self.int8_max_rows < 2:
            self.int8 = None  # 1 byte per weight not worth keeping
        elif self.int8 is None:  # picked in an earlier engine of this process
            self.quantize_int8()


def int8_rows_crossover(sizes: tuple[int, ...], won: list[bool]) -> int:
    """The most rows a step takes int8 blocks for: the last size of the unbroken run of wins from
    the smallest (1: none; a win after a loss does not count), unbounded when int8 won every size."""
    best = 1
    for rows, w in zip(sizes, won):
        if not w:
            return best
        best = rows
    return UNBOUNDED if len(won) == len(sizes) else best


def choose_one_row_kernel(seconds: dict[str, float]) -> str:
    """The fastest exact kernel ("mv", "gemm"), unless int8 rows take under INT8_MARGIN of its time:
    int8's logits differ more, so a near tie (where timing noise could flip the choice from one
    start to the next) keeps bf16."""
    exact = [k for k in seconds if k != "int8"]
    if not exact:
        return "int8"
    fastest = min(exact, key=seconds.__getitem__)
    return "int8" if seconds.get("int8", float("inf")) < INT8_MARGIN * seconds[fastest] else fastest


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same vocab split; calling it gives the logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.project(hidden)
