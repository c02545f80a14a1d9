"""Attention over the paged KV pool with Triton kernels (GPU; the CPU interpreter in tests).

Per step (init_metadata, host side, one host→device copy):
    tokens   = [ decode-like chunks (1 token each) | extend chunks (ragged) ]
    one int32 buffer holds, for every sequence b (decode rows first):
        kv_lens[b], prefix_lens[b] (= start), new_lens[b], q_starts[b] (first row in q),
        slots[t] for every new token, page_table[b, :max_pages] (padding entries = page 0)
    and is copied to the device once; the metadata holds views into it.
Per layer (forward): store K/V into their slots, decode kernel over rows [0, num_decode),
extend kernel over the rest, both writing into one output: no host syncs, no Python loop
over requests, so the decode path can be captured in a CUDA graph.

CUDA graphs (ketch/runner/triton_graphs.py) build a `TritonAttentionMetadata` over static
buffers once per captured batch size (page_table [max_bs, max_pages], seq_lens, scratch for a
fixed `num_splits`), fill the buffers in place each step (padded rows: seq_len 0, slot -1 →
zeros, nothing written) and replay.

Split count: `decode_splits` fixes it; else it is picked per step from the batch size and
`decode_splits_len` when given (the runner passes max_model_len, so the count depends on the
batch size only and an eager step computes exactly what the graph of that size computes),
else from the step's longest sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ketch.attention.base import AttentionBackend
from ketch.cache.kv_pool import KVPool
from ketch.forward_batch import ForwardBatch
from ketch.kernels._common import interpreting
from ketch.kernels.decode_attention import (
    decode_attention,
    decode_scratch,
    num_splits_for,
)
from ketch.kernels.extend_attention import extend_attention
from ketch.kernels.kv_store import store_kv
from ketch.host_copy import to_device


@dataclass
class DecodeMetadata:
    page_table: torch.Tensor  # [batch, max_pages] int32
    seq_lens: torch.Tensor  # [batch] int32, KV length including this step's token
    num_splits: int
    scratch: tuple[torch.Tensor, torch.Tensor]  # fp32 partial outputs / lse, reused by every layer


@dataclass
class ExtendMetadata:
    page_table: torch.Tensor  # [batch, max_pages] int32
    prefix_lens: torch.Tensor  # [batch] int32, tokens already in the pool
    new_lens: torch.Tensor  # [batch] int32
    q_starts: torch.Tensor  # [batch] int32, row of the first new token in q/k/v
    max_new: int  # host copy of max(new_lens): sizes the grid without a sync


@dataclass
class TritonAttentionMetadata:
    slots: torch.Tensor  # [tokens] int32, pool slot of every new token
    num_decode: int
    decode: DecodeMetadata | None
    extend: ExtendMetadata | None


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, device: torch.device, *,
                 decode_block_n: int = 64, decode_splits: int | None = None, max_splits: int = 16,
                 decode_splits_len: int | None = None, extend_block_m: int = 64, extend_block_n: int = 64) -> None:
        """decode_splits: a fixed split count; None picks one per step (`splits_for`), up to
        max_splits, assuming sequences of decode_splits_len tokens (None: the step's longest)."""
        self.pool = pool
        self.page_size = pool.page_size
        self.num_heads = num_heads
        self.num_kv_heads = pool.k[0].shape[2]
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.device = torch.device(device)
        if self.device.type != "cuda" and not interpreting():
            raise ValueError(f"attention_backend: 'triton' needs a CUDA device (or TRITON_INTERPRET=1), got {self.device}")
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads: {num_heads} is not a multiple of the pool's {self.num_kv_heads} kv heads")
        if decode_splits is not None and decode_splits < 1:
            raise ValueError(f"decode_splits: must be >= 1, got {decode_splits}")
        self.decode_block_n = decode_block_n
        self.decode_splits = decode_splits
        self.max_splits = max_splits
        self.decode_splits_len = decode_splits_len
        self.extend_block_m = extend_block_m
        self.extend_block_n = extend_block_n
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 132
        self.target_programs = 2 * sms

    def init_metadata(self, batch: ForwardBatch) -> TritonAttentionMetadata:
        b, t, nd = batch.num_seqs, batch.num_tokens, batch.num_decode
        kv_lens = batch.kv_lens
        table = batch.page_table
        host = np.concatenate((kv_lens, batch.starts, batch.num_new, batch.q_starts, batch.slots, table.ravel()))
        buf = to_device(host.astype(np.int32), self.device)  # the step's only host→device copy (no sync)
        kv_t, start_t, new_t, qs_t = (buf[i * b : (i + 1) * b] for i in range(4))
        slots_t = buf[4 * b : 4 * b + t]
        table_t = buf[4 * b + t :].view(b, table.shape[1])

        decode = extend = None
        if nd:
            splits = self.splits_for(nd, int(kv_lens[:nd].max()))
            scratch = decode_scratch(nd, self.num_heads, self.head_dim, splits, self.device)
            decode = DecodeMetadata(table_t[:nd], kv_t[:nd], splits, scratch)
        if nd < b:
            extend = ExtendMetadata(table_t[nd:], start_t[nd:], new_t[nd:], qs_t[nd:], int(batch.num_new[nd:].max()))
        return TritonAttentionMetadata(slots_t, nd, decode, extend)

    def splits_for(self, batch: int, longest: int) -> int:
        """The decode split count of a batch whose longest sequence has `longest` tokens."""
        if self.decode_splits:
            return self.decode_splits
        return num_splits_for(batch, self.num_kv_heads, self.decode_splits_len or longest, block_n=self.decode_block_n,
                              target_programs=self.target_programs, max_splits=self.max_splits)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: TritonAttentionMetadata) -> torch.Tensor:
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        store_kv(kc, vc, k, v, meta.slots)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.decode is not None:
            d, nd = meta.decode, meta.num_decode
            decode_attention(q[:nd], kc, vc, d.page_table, d.seq_lens, self.scale, out=out[:nd],
                             scratch=d.scratch, num_splits=d.num_splits, block_n=self.decode_block_n)
        if meta.extend is not None:
            e = meta.extend
            extend_attention(q, k, v, kc, vc, e.page_table, e.prefix_lens, e.new_lens, e.q_starts, e.max_new,
                             self.scale, out=out, block_m=self.extend_block_m, block_n=self.extend_block_n)
        return out
