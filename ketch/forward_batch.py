"""One step of the model as plain data: what the runner, the attention backends and the graph
runner read. Built once per step (the engine builds it from the scheduler's choice,
engine/step_batch.py); nothing below the engine sees a request.

    token stream  [ seq 0's new tokens | seq 1's | ... ]      decode-like sequences (1 token) first
    input_ids     [T]  int64; a negative id is a placeholder for a token still being sampled on
                       the device (overlap: runner/future_tokens.py resolves it there)
    positions     [T]  position of each token in its sequence
    slots         [T]  KV pool slot of each token: page_table[pos // page_size] * page_size
                       + pos % page_size — the one place this formula lives
    seqs          [B]  (start, num_new, page_table) per sequence
    page_table    [B, max_pages] int64, each row's pages then zeros (padding is never read past
                       a row's kv_len)
    sample_rows   [R]  token indices whose logits the step returns, in sampling order; a sequence
                       may own several (speculative verify: k + 1), `sample_seqs` says whose

The kind is fixed by the data: DECODE when every sequence runs one token and samples it (what a
decode CUDA graph can replay), EXTEND otherwise.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class StepKind(enum.Enum):
    DECODE = "decode"  # one new token per sequence, each sampled
    EXTEND = "extend"  # prefill chunks, possibly with decode rows in front


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step: tokens [start, start + num_new) of it."""

    start: int  # tokens already in the KV pool (position of the first new token)
    num_new: int
    page_table: Sequence[int]  # covers at least start + num_new tokens

    @property
    def kv_len(self) -> int:
        return self.start + self.num_new


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    kind: StepKind
    page_size: int
    seqs: tuple[SeqChunk, ...]
    num_decode: int  # leading sequences with num_new == 1
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64
    starts: np.ndarray  # [B] int64
    num_new: np.ndarray  # [B] int64
    q_starts: np.ndarray  # [B] int64, index of each sequence's first token in the stream
    page_table: np.ndarray  # [B, max_pages] int64
    sample_rows: np.ndarray  # [R] int64
    sample_seqs: np.ndarray  # [R] int64

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def __len__(self) -> int:  # sequences, as a list of them would count
        return len(self.seqs)

    @property
    def kv_lens(self) -> np.ndarray:
        return self.starts + self.num_new

    @property
    def pages_used(self) -> np.ndarray:
        """Pages each sequence's kv_len spans."""
        return -(-self.kv_lens // self.page_size)

    @classmethod
    def build(cls, seqs: Sequence[SeqChunk], page_size: int, input_ids: Sequence[int] | None = None,
              sample_rows: Sequence[int] | None = None, sample_seqs: Sequence[int] | None = None) -> "ForwardBatch":
        """The batch of `seqs` (decode-like ones first). input_ids default to zeros (shape-only
        batches: memory profiling, kernel tests); sample_rows default to each sequence's last token."""
        seqs = tuple(seqs)
        b = len(seqs)
        starts = np.fromiter((s.start for s in seqs), np.int64, b)
        news = np.fromiter((s.num_new for s in seqs), np.int64, b)
        num_decode = _leading_decode(news)
        kv_lens = starts + news
        n_pages = -(-kv_lens // page_size)
        table = np.zeros((b, max(1, int(n_pages.max(initial=0)))), np.int64)
        for i, s in enumerate(seqs):
            if len(s.page_table) < n_pages[i]:
                raise ValueError(f"page_table: {len(s.page_table)} pages cannot hold {kv_lens[i]} tokens")
            table[i, : n_pages[i]] = s.page_table[: n_pages[i]]
        q_starts = np.cumsum(news) - news
        owner = np.repeat(np.arange(b), news)  # sequence of every token
        positions = np.arange(owner.size) - q_starts[owner] + starts[owner]
        slots = table[owner, positions // page_size] * page_size + positions % page_size
        t = owner.size
        ids = np.zeros(t, np.int64) if input_ids is None else np.asarray(input_ids, np.int64)
        if ids.shape != (t,):
            raise ValueError(f"input_ids: {ids.shape[0]} ids for {t} tokens")
        if sample_rows is None:
            rows, owners = q_starts + news - 1, np.arange(b)
        else:
            rows = np.asarray(sample_rows, np.int64)
            owners = owner[rows] if sample_seqs is None else np.asarray(sample_seqs, np.int64)
        decode = num_decode == b and b > 0 and rows.size == b and bool((rows == q_starts).all())
        return cls(StepKind.DECODE if decode else StepKind.EXTEND, page_size, seqs, num_decode, ids, positions,
                   slots, starts, news, q_starts, table, rows, owners)


def _leading_decode(news: np.ndarray) -> int:
    """How many sequences lead with num_new == 1; a decode-like one after a longer one is refused."""
    num_decode = int(np.count_nonzero(news == 1))
    if num_decode and not (news[:num_decode] == 1).all():
        raise ValueError("seqs: decode-like chunks (num_new == 1) must come first")
    return num_decode
