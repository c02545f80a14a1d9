"""Reference attention over the paged KV pool, in plain torch (SDPA). Runs on any device.

Per step:   tokens = [ decode-like chunks (1 token each) | prefill chunks (ragged) ]
- decode-like chunks are batched: their pages are gathered into [B, pages*page_size] and
  masked beyond each sequence's length;
- a prefill chunk with nothing cached attends causally to its own K/V;
- a prefill chunk after a cached prefix gathers its pages and uses an explicit causal mask
  shifted by the prefix length.

A narrower pool (fp8 KV) is read through `KVPool.gather`, which casts up to the model's dtype.
A prefill chunk attends to its own new tokens at full precision (the K/V it was handed, not
their fp8 copy), as the Triton extend kernel does; cached tokens and decode read the pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ketch.attention.base import AttentionBackend
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


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, head_dim: int, device: torch.device) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.scale = head_dim**-0.5
        self.device = device

    def init_metadata(self, batch: ForwardBatch) -> TorchAttentionMetadata:
        ps, nd = self.page_size, batch.num_decode
        used = batch.pages_used
        decode_pages = decode_mask = None
        if nd:
            width = int(used[:nd].max())
            decode_pages = to_device(batch.page_table[:nd, :width], self.device, torch.long)  # zeros past a row's pages
            lens = to_device(batch.kv_lens[:nd], self.device, torch.long)
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
        )

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """Bool mask → additive float mask, built once per step instead of once per layer."""
        zeros = torch.zeros(visible.shape, dtype=self.pool.compute_dtype, device=self.device)
        return zeros.masked_fill_(~visible, float("-inf"))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: TorchAttentionMetadata) -> torch.Tensor:
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
        """One query token per sequence, [B, heads, dim], over its gathered, masked pages."""
        kc, vc = self.pool.gather(layer, meta.decode_pages)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, heads, 1, dim]
            kc.transpose(1, 2),
            vc.transpose(1, 2),
            attn_mask=meta.decode_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)
