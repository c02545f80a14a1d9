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

from ketch.attention.base import AttentionBackend, SeqChunk
from ketch.cache.kv_pool import KVPool
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

    def init_metadata(self, seqs: list[SeqChunk]) -> TorchAttentionMetadata:
        ps = self.page_size
        slots: list[int] = []
        for s in seqs:
            table = s.page_table
            slots.extend(table[p // ps] * ps + p % ps for p in range(s.start, s.kv_len))
        decodes = [s for s in seqs if s.num_new == 1]
        num_decode = len(decodes)
        assert all(s.num_new == 1 for s in seqs[:num_decode]), "decode-like chunks must come first"
        decode_pages = decode_mask = None
        if decodes:
            max_pages = max(-(-s.kv_len // ps) for s in decodes)
            table = [s.page_table[: -(-s.kv_len // ps)] + [0] * (max_pages - -(-s.kv_len // ps)) for s in decodes]
            decode_pages = to_device(table, self.device, torch.long)
            lens = to_device([s.kv_len for s in decodes], self.device, torch.long)
            visible = torch.arange(max_pages * ps, device=self.device)[None, :] < lens[:, None]
            decode_mask = self._additive(visible)[:, None, None, :]
        prefills: list[PrefillMeta] = []
        lo = num_decode
        for s in seqs[num_decode:]:
            hi = lo + s.num_new
            if s.start == 0:
                prefills.append(PrefillMeta(lo, hi, 0, None, None))
            else:
                n_pages = -(-s.kv_len // ps)
                pages = to_device([s.page_table[:n_pages]], self.device, torch.long)
                q_pos = torch.arange(s.start, s.kv_len, device=self.device)
                mask = torch.arange(n_pages * ps, device=self.device)[None, :] <= q_pos[:, None]
                prefills.append(PrefillMeta(lo, hi, s.start, pages, self._additive(mask)[None, None]))
            lo = hi
        return TorchAttentionMetadata(
            slots=to_device(slots, self.device, torch.long),
            num_decode=num_decode,
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
