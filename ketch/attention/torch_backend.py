"""Reference attention over the paged KV pool, in plain torch (SDPA). Runs on any device.

Per step:   tokens = [ decode-like chunks (1 token each) | prefill chunks (ragged) ]
- decode-like chunks are batched: their pages are gathered into [B, pages*page_size] and
  masked beyond each sequence's length (one sequence on consecutive pages, the common batch-1
  case, reads them as a view instead: two copies per layer fewer);
- a prefill chunk with nothing cached attends causally to its own K/V;
- a prefill chunk after a cached prefix gathers its pages and uses an explicit causal mask
  shifted by the prefix length.

Decode CUDA graphs (the graph hooks below; ketch/runner/graph_runner.py captures and replays):
    key          = (batch size, page bucket), the page bucket a power of two, captured on first
                   use (a server meets few of them, and most (size, bucket) pairs never occur)
    static       ids, positions, slots, lens [max_bs], pages [max_bs, bucket(max pages)] int64,
                   filled by one host→device copy of the vectors and one of the page rows
    padded rows  = copies of row 0 (same token, position, slot, pages): they compute the very
                   same K/V and write it to row 0's slot, so padding never touches another
                   request's pages, and rerunning a step (warm-up before capture) changes nothing
    padded pages = the row's own first page, masked out (-inf) like the eager path's padding
The mask is built inside the graph from the static lengths (`capture_inputs`).

A narrower pool (fp8 KV) is read through `KVPool.gather`, which casts up to the model's dtype.
A prefill chunk attends to its own new tokens at full precision (the K/V it was handed, not
their fp8 copy), as the Triton extend kernel does; cached tokens and decode read the pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ketch.attention.base import AttentionBackend, GraphInputs, GraphKey
from ketch.cache.kv_pool import KVPool
from ketch.forward_batch import ForwardBatch
from ketch.host_copy import to_device


@dataclass
class PrefillMeta:
    lo: int
    hi: int
    start: int  # tokens cached before the chunk (its first new token's position)
    page_table: torch.Tensor | None  # [1, pages]; None when nothing was cached before the chunk
    mask: torch.Tensor | None  # [1, 1, new, pages * page_size] additive (0 / -inf)


@dataclass
class TorchAttentionMetadata:
    slots: torch.Tensor  # [tokens] slot of each new token
    num_decode: int
    decode_pages: torch.Tensor | None  # [B, max_pages]
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_pages * page_size] additive (0 / -inf)
    prefills: list[PrefillMeta]
    # one decoding sequence whose pages are consecutive (a lone request on a fresh pool: the
    # allocator hands out ascending pages): its first page, read as a view, not gathered
    decode_first_page: int | None = None
    decode_lens: torch.Tensor | None = None  # [B] int64: the native decode kernel's lengths


@dataclass
class GraphBuffers:
    """The decode graphs' static inputs (module docstring), shared by every graph."""

    ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor
    slots: torch.Tensor
    lens: torch.Tensor
    pages: torch.Tensor  # [max_bs, bucket(max pages)] int64

    @property
    def max_pages(self) -> int:
        return self.pages.shape[1]


def _bucket(n: int) -> int:
    """Smallest power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, head_dim: int, device: torch.device) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.scale = head_dim**-0.5
        self.device = device
        self.graph_buffers: GraphBuffers | None = None  # init_capture's, when a graph runner is built
        # bf16 K/V on the CPU: decode reads the pages in place (ketch/native/decode_attention.c)
        # instead of gathering them for SDPA; fp32 (the parity configuration) and fp8 pools keep SDPA
        self.native_decode = self.native_store_decode = None
        if (pool.dtype == pool.compute_dtype == torch.bfloat16 and torch.device(device).type == "cpu"
                and {"k", "v"} <= set(pool.spec.names)):
            from ketch.native import decode_attention as native

            if native.available():
                self.native_decode = native.decode_attention
                # a decode-only step stores its K/V and attends in one call a layer
                self.native_store_decode = native.store_decode_attention

    def init_metadata(self, batch: ForwardBatch) -> TorchAttentionMetadata:
        ps, nd = self.page_size, batch.num_decode
        used = batch.pages_used
        decode_pages = decode_mask = first = None
        if nd:
            width = int(used[:nd].max())
            if nd == 1 and (width == 1 or bool((np.diff(batch.page_table[0, :width]) == 1).all())):
                first = int(batch.page_table[0, 0])
            decode_pages = to_device(batch.page_table[:nd, :width], self.device, torch.long)  # zeros past a row's pages
            lens = to_device(batch.kv_lens[:nd], self.device, torch.long)
            if self.native_decode is None:
                visible = torch.arange(width * ps, device=self.device)[None, :] < lens[:, None]
                decode_mask = self._additive(visible)[:, None, None, :]
        prefills: list[PrefillMeta] = []
        for i in range(nd, batch.num_seqs):
            lo, start = int(batch.q_starts[i]), int(batch.starts[i])
            hi = lo + int(batch.num_new[i])
            if start == 0:
                prefills.append(PrefillMeta(lo, hi, 0, None, None))
                continue
            n_pages = int(used[i])
            pages = to_device(batch.page_table[i : i + 1, :n_pages], self.device, torch.long)
            q_pos = torch.arange(start, start + hi - lo, device=self.device)
            mask = torch.arange(n_pages * ps, device=self.device)[None, :] <= q_pos[:, None]
            prefills.append(PrefillMeta(lo, hi, start, pages, self._additive(mask)[None, None]))
        return TorchAttentionMetadata(
            slots=to_device(batch.slots, self.device, torch.long),
            num_decode=nd,
            decode_pages=decode_pages,
            decode_mask=decode_mask,
            prefills=prefills,
            decode_lens=lens if nd else None,
            decode_first_page=first,
        )

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """Bool mask → additive float mask, built once per step instead of once per layer."""
        zeros = torch.zeros(visible.shape, dtype=self.pool.compute_dtype, device=self.device)
        return zeros.masked_fill_(~visible, float("-inf"))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: TorchAttentionMetadata,
                stored: bool = False) -> torch.Tensor:
        if stored:
            raise ValueError("stored: this backend gave no kv_sink; it stores k and v itself")
        if self.native_store_decode is not None and not meta.prefills and meta.decode_lens is not None:
            return self.native_store_decode(q, k, v, meta.slots, self.pool.k[layer], self.pool.v[layer],
                                            meta.decode_pages, meta.decode_lens, self.scale)
        self.pool.store(layer, meta.slots, k, v)
        nd = meta.num_decode
        if not meta.prefills:  # the common decode-only step: no output assembly
            return self._decode(q, layer, meta)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], layer, meta)
        for p in meta.prefills:
            qs = q[p.lo : p.hi].transpose(0, 1).unsqueeze(0)  # [1, heads, new, dim]
            if p.page_table is None:
                ks, vs = k[p.lo : p.hi].transpose(0, 1).unsqueeze(0), v[p.lo : p.hi].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                kc, vc = self.pool.gather(layer, p.page_table)
                # the new tokens as handed in (the same values unless the pool is narrower)
                kc[0, p.start : p.start + p.hi - p.lo] = k[p.lo : p.hi]
                vc[0, p.start : p.start + p.hi - p.lo] = v[p.lo : p.hi]
                o = F.scaled_dot_product_attention(
                    qs, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=p.mask, scale=self.scale, enable_gqa=True
                )
            out[p.lo : p.hi] = o.squeeze(0).transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, layer: int, meta: TorchAttentionMetadata) -> torch.Tensor:
        """One query token per sequence, [B, heads, dim], over its gathered, masked pages (one
        sequence on consecutive pages: a view of them, the same values without the copy), or with
        bf16 pages on the CPU the native kernel reading them in place."""
        if self.native_decode is not None and meta.decode_lens is not None:
            return self.native_decode(q, self.pool.k[layer], self.pool.v[layer], meta.decode_pages,
                                      meta.decode_lens, self.scale)
        if meta.decode_first_page is None:
            kc, vc = self.pool.gather(layer, meta.decode_pages)
        else:
            kc, vc = self.pool.span(layer, meta.decode_first_page, meta.decode_pages.shape[1])
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, heads, 1, dim]
            kc.transpose(1, 2),
            vc.transpose(1, 2),
            attn_mask=meta.decode_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)

    # ------------------------------------------------------------ decode-graph hooks
    def init_capture(self, sizes: list[int], max_model_len: int) -> list[GraphKey]:
        max_bs, long = max(sizes), dict(dtype=torch.long, device=self.device)
        max_pages = _bucket(-(-max_model_len // self.page_size))
        self.graph_buffers = GraphBuffers(
            ids=torch.zeros(max_bs, **long), positions=torch.zeros(max_bs, **long),
            slots=torch.zeros(max_bs, **long), lens=torch.ones(max_bs, **long),
            pages=torch.zeros(max_bs, max_pages, **long),
        )
        return []  # each (size, page bucket) on first use

    def graph_key(self, batch: ForwardBatch, bs: int) -> GraphKey | None:
        pb = _bucket(int(batch.pages_used.max()))
        return (bs, pb) if pb <= self.graph_buffers.max_pages else None

    def capture_inputs(self, key: GraphKey) -> GraphInputs:
        bs, pb = key
        g = self.graph_buffers
        visible = torch.arange(pb * self.page_size, device=self.device)[None, :] < g.lens[:bs, None]
        meta = TorchAttentionMetadata(slots=g.slots[:bs], num_decode=bs, decode_pages=g.pages[:bs, :pb],
                                      decode_mask=self._additive(visible)[:, None, None, :], prefills=[])
        return GraphInputs(g.ids[:bs], g.positions[:bs], meta)

    def prepare_replay(self, batch: ForwardBatch, key: GraphKey) -> None:
        """Padded rows and pages as the module docstring says; two host→device copies."""
        (bs, pb), g, n = key, self.graph_buffers, batch.num_seqs
        used = batch.pages_used
        rows = np.empty((bs, pb), np.int64)
        rows[:n, : batch.page_table.shape[1]] = batch.page_table
        # past its own pages a row repeats its first page (masked out, never written)
        rows[:n] = np.where(np.arange(pb)[None, :] < used[:, None], rows[:n], rows[:n, :1])
        rows[n:] = rows[0]  # padded rows are copies of row 0
        pad = bs - n
        vectors = np.stack([np.concatenate((v, v[:1].repeat(pad)))
                            for v in (batch.input_ids, batch.positions, batch.slots, batch.kv_lens)])
        dev = to_device(vectors, self.device, torch.long)
        for i, static in enumerate((g.ids, g.positions, g.slots, g.lens)):
            static[:bs].copy_(dev[i])
        g.pages[:bs, :pb].copy_(to_device(rows, self.device, torch.long))
