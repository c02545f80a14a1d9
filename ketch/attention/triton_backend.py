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

Decode CUDA graphs (the graph hooks below; ketch/runner/graph_runner.py captures and replays):
every runner size is captured at init, key (bs, splits, tile): its long shape, and beside it the
short shape where that differs (SHORT_SPAN). Static buffers, shared by every graph (they
replay one at a time, on one stream):

    stage  int32 [4 * max_bs + max_bs * max_pages]  ← the step's one host→device copy (pinned)
           the graph of size bs reads ids, positions, kv_lens, slots at stage[0:bs],
           [bs:2bs], [2bs:3bs], [3bs:4bs]; the page rows [n, w] follow them
    table  int32 [max_bs, max_pages]   page table with a fixed row stride (baked into the
           graph); each step copies its [n, w] block in from the stage (one device copy).
           Columns past a row's length are stale and never read: kernels stop at kv_len.
    scratch fp32 split-K partials for the largest bs × splits, viewed per size

Padded rows: token 0 at position 0, kv_len 0, slot -1: the KV store writes nothing and
attention returns zeros, so padding never touches a request's pages. The decode shape (split
count and tile) is a function of the size and of whether the step's longest sequence fits the
short span (`decode_shape`), and an eager decode step of the same batch size picks it the same
way, so greedy output is bit-identical with graphs on or off.

Split count: `decode_splits` fixes it; else, for a step of at most SHORT_MAX_BS rows whose
sequences fit SHORT_SPAN tokens, one split per tile of the short span (the short shape: at a
short context the long shape's splits are mostly empty, and their programs still launch, wait
and write); else it is picked from the batch size and `decode_splits_len` when given (the
runner passes max_model_len, so the count depends on the batch size only), else from the
step's longest sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ketch.attention.base import AttentionBackend, GraphInputs, GraphKey
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


PAD = np.array((0, 0, 0, -1), dtype=np.int32)[:, None]  # token, position, kv_len, slot of a padded row


@dataclass
class DecodeMetadata:
    page_table: torch.Tensor  # [batch, max_pages] int32
    seq_lens: torch.Tensor  # [batch] int32, KV length including this step's token
    num_splits: int
    scratch: tuple[torch.Tensor, torch.Tensor]  # fp32 partial outputs / lse, reused by every layer
    block_n: int  # KV rows a split program takes per step (the split kernels' tile)


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


@dataclass
class GraphBuffers:
    """The decode graphs' static buffers (module docstring); one set serves every size."""

    stage: torch.Tensor  # int32 [4 * max_bs + max_bs * max_pages], device
    host: torch.Tensor  # its pinned host twin (CUDA), the source of the step's one copy
    host_np: np.ndarray  # numpy view of `host`, filled per step
    table: torch.Tensor  # int32 [max_bs, max_pages], fixed row stride
    mid_o: torch.Tensor  # fp32 split-K partial outputs for the largest bs × splits
    mid_lse: torch.Tensor
    copied: torch.cuda.Event | None  # the last copy has read `host` (CUDA only)


# Decode defaults (read when a backend is built: GPU sweeps set them through scripts/with_constants.py):
# the KV rows a split program takes per step, and the most splits of a sequence (the scratch size)
DECODE_BLOCK_N = 64
MAX_SPLITS = 32
# The short shape: a decode step of at most SHORT_MAX_BS rows whose sequences all fit SHORT_SPAN
# tokens runs splits of SHORT_TILES tiles (the backend's short tile), sized for SHORT_SPAN; its graph
# is captured beside the long one. At a short context the long shape (sized for max_model_len)
# launches mostly empty splits, and MLA's tile is narrower there (mla_triton_backend.SHORT_BLOCK_N).
SHORT_SPAN = 256
SHORT_MAX_BS = 1
SHORT_TILES = 1  # tiles a split of the short shape holds (at least)
SHORT_BLOCK_N = 0  # the short shape's tile (0: DECODE_BLOCK_N, as the long shape)


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, device: torch.device, *,
                 decode_block_n: int | None = None, decode_splits: int | None = None, max_splits: int | None = None,
                 decode_splits_len: int | None = None, extend_block_m: int = 64, extend_block_n: int = 64) -> None:
        """decode_splits: a fixed split count; None picks one per step (`splits_for`), up to
        max_splits, assuming sequences of decode_splits_len tokens (None: the step's longest).
        decode_block_n / max_splits None: the module's DECODE_BLOCK_N / MAX_SPLITS."""
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
        self.decode_block_n = decode_block_n or DECODE_BLOCK_N
        self.decode_splits = decode_splits
        self.max_splits = max_splits or MAX_SPLITS
        self.decode_splits_len = decode_splits_len
        self.init_short_shape(SHORT_BLOCK_N or self.decode_block_n)
        self.extend_block_m = extend_block_m
        self.extend_block_n = extend_block_n
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 132
        self.target_programs = 2 * sms
        self.graph_buffers: GraphBuffers | None = None  # init_capture's, when a graph runner is built

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
            splits, block_n = self.decode_shape(nd, int(kv_lens[:nd].max()))
            scratch = decode_scratch(nd, self.num_heads, self.head_dim, splits, self.device)
            decode = DecodeMetadata(table_t[:nd], kv_t[:nd], splits, scratch, block_n)
        if nd < b:
            extend = ExtendMetadata(table_t[nd:], start_t[nd:], new_t[nd:], qs_t[nd:], int(batch.num_new[nd:].max()))
        return TritonAttentionMetadata(slots_t, nd, decode, extend)

    def init_short_shape(self, block_n: int) -> None:
        """The short shape's bounds (the module's, read now: GPU sweeps set them) and tile."""
        self.short_span, self.short_max_bs, self.short_tiles, self.short_block_n = \
            SHORT_SPAN, SHORT_MAX_BS, SHORT_TILES, block_n

    def decode_shape(self, batch: int, longest: int) -> tuple[int, int]:
        """(split count, tile) of a decode step of `batch` rows whose longest sequence has
        `longest` tokens: the short shape when it qualifies (SHORT_SPAN), else `splits_for`
        with the decode tile. A graph of size `batch` computes exactly what an eager step of
        `batch` rows does, both keyed by this."""
        if not self.decode_splits and batch <= self.short_max_bs and longest <= self.short_span:
            return self.split_count(batch, self.short_span, self.short_block_n, self.short_tiles), self.short_block_n
        return self.splits_for(batch, longest), self.decode_block_n

    def splits_for(self, batch: int, longest: int) -> int:
        """The decode split count of a batch whose longest sequence has `longest` tokens (the long shape)."""
        if self.decode_splits:
            return self.decode_splits
        return self.split_count(batch, self.decode_splits_len or longest, self.decode_block_n)

    def split_count(self, batch: int, span: int, block_n: int, min_blocks: int = 2) -> int:
        return num_splits_for(batch, self.num_kv_heads, span, block_n=block_n, target_programs=self.target_programs,
                              max_splits=self.max_splits, min_blocks=min_blocks)

    def kv_sink(self, layer: int, meta: TritonAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.pool.k[layer], self.pool.v[layer], meta.slots

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: TritonAttentionMetadata,
                stored: bool = False) -> torch.Tensor:
        """stored: k and v are in the pool already (kv_sink)."""
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        if not stored:
            store_kv(kc, vc, k, v, meta.slots)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.decode is not None:
            d, nd = meta.decode, meta.num_decode
            decode_attention(q[:nd], kc, vc, d.page_table, d.seq_lens, self.scale, out=out[:nd],
                             scratch=d.scratch, num_splits=d.num_splits, block_n=d.block_n)
        if meta.extend is not None:
            e = meta.extend
            extend_attention(q, k, v, kc, vc, e.page_table, e.prefix_lens, e.new_lens, e.q_starts, e.max_new,
                             self.scale, out=out, block_m=self.extend_block_m, block_n=self.extend_block_n)
        return out

    # ------------------------------------------------------------ decode-graph hooks
    def init_capture(self, sizes: list[int], max_model_len: int) -> list[GraphKey]:
        max_bs = max(sizes)
        max_pages = -(-max_model_len // self.page_size)
        # every size's long shape, and its short shape where that differs: keys (bs, splits, tile)
        lengths = {max_model_len, min(self.short_span, max_model_len)}
        keys = sorted({(bs, *self.decode_shape(bs, n)) for bs in sizes for n in lengths})
        n_stage = 4 * max_bs + max_bs * max_pages
        cuda = self.device.type == "cuda"
        host = torch.zeros(n_stage, dtype=torch.int32, pin_memory=cuda)
        partials = max(bs * splits for bs, splits, _ in keys) * self.num_heads
        self.graph_buffers = GraphBuffers(
            stage=torch.zeros(n_stage, dtype=torch.int32, device=self.device), host=host, host_np=host.numpy(),
            table=torch.zeros(max_bs, max_pages, dtype=torch.int32, device=self.device),
            mid_o=torch.empty(partials * self.head_dim, dtype=torch.float32, device=self.device),
            mid_lse=torch.empty(partials, dtype=torch.float32, device=self.device),
            copied=torch.cuda.Event() if cuda else None,
        )
        return keys  # all at init: no capture stalls a running server

    def graph_key(self, batch: ForwardBatch, bs: int) -> GraphKey | None:
        return (bs, *self.decode_shape(bs, int(batch.kv_lens.max())))

    def prepare_capture(self, key: GraphKey) -> None:
        bs = key[0]
        # padded rows only: warm-up and capture write nothing into the pool
        self.graph_buffers.stage[: 4 * bs].view(4, bs).copy_(torch.from_numpy(PAD).expand(4, bs))

    def capture_inputs(self, key: GraphKey) -> GraphInputs:
        bs, splits, block_n = key
        g, h, d, s = self.graph_buffers, self.num_heads, self.head_dim, self.graph_buffers.stage
        scratch = (g.mid_o[: bs * h * splits * d].view(bs, h, splits, d), g.mid_lse[: bs * h * splits].view(bs, h, splits))
        decode = DecodeMetadata(g.table[:bs], s[2 * bs : 3 * bs], splits, scratch, block_n)
        return GraphInputs(s[:bs], s[bs : 2 * bs], TritonAttentionMetadata(s[3 * bs : 4 * bs], bs, decode, None))

    def prepare_replay(self, batch: ForwardBatch, key: GraphKey) -> None:
        """One pinned host→device copy of ids, positions, kv_lens, slots and page rows, then one
        device copy of the rows into the fixed-stride table. No sync with the device."""
        bs, g, n = key[0], self.graph_buffers, batch.num_seqs
        width = batch.page_table.shape[1]  # the widest row's pages
        if g.copied is not None:
            g.copied.synchronize()  # the previous step's copy has read the host buffer
        vec = g.host_np[: 4 * bs].reshape(4, bs)
        vec[0, :n], vec[1, :n], vec[3, :n] = batch.input_ids, batch.positions, batch.slots
        vec[2, :n] = vec[1, :n] + 1
        vec[:, n:] = PAD
        used = 4 * bs + n * width
        g.host_np[4 * bs : used].reshape(n, width)[:] = batch.page_table
        g.stage[:used].copy_(g.host[:used], non_blocking=True)
        if g.copied is not None:
            g.copied.record()
        g.table[:n, :width].copy_(g.stage[4 * bs : used].view(n, width))
