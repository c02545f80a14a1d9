"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged pool of latents, in plain torch.

The pool keeps ONE tensor per layer and token (the family's KV spec): the latent
    c_kv | k_pe      [kv_lora_rank + rope_dim]: the kv_a_layernorm-ed compressed KV and the
                     rotated, head-shared rope key
K and V are never stored. With W_UK [heads, nope, rank] and W_UV [heads, v, rank] the two halves
of kv_b_proj's weight, per head h:
    k_h = [W_UK_h c | k_pe]     v_h = W_UV_h c      score = q_nope·W_UK_h c + q_pe·k_pe

Two forms of the same product (`mla_expanded`, `mla_absorbed`, tested equal):
    expanded  (prefill / extend chunks): up-project every cached latent into per-head K and V,
              then ordinary attention with head dim nope + rope and value dim v; costs
              O(tokens x heads x (nope + v) x rank) per chunk, fine when many queries share it
    absorbed  (decode rows): fold W_UK into the query (q_nope W_UK_h -> the latent space), score
              it against the cached latents directly, attend in the latent space and apply
              W_UV_h once to the [heads, rank] result: nothing per cached token is expanded

The step's metadata, and the decode-graph hooks over it, are the torch MHA backend's
(torch_backend.py): only slots, pages and masks, which do not depend on what a page holds.
A prefill chunk attends to its own new latents as handed in (full precision), cached tokens
and decode read the pool (cast up from fp8 when the pool is narrower), as the MHA backend does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ketch.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from ketch.cache.kv_pool import KVPool


def mla_expanded(q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor | None, w_uk: torch.Tensor,
                 w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, heads, n, nope + rope] (q_pe rotated); latent [B, L, rank + rope]; mask additive,
    broadcastable to [B, heads, n, L] (None: causal, n == L). Returns [B, heads, n, v]."""
    rank, heads = w_uk.shape[2], w_uk.shape[0]
    c, k_pe = latent[..., :rank], latent[..., rank:]
    k_nope = torch.einsum("blr,hnr->bhln", c, w_uk)
    v = torch.einsum("blr,hvr->bhlv", c, w_uv)
    k = torch.cat((k_nope, k_pe[:, None].expand(-1, heads, -1, -1)), -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


def mla_absorbed(q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor | None, w_uk: torch.Tensor,
                 w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """The same inputs and result as `mla_expanded` (mask required), without expanding K or V."""
    nope, rank = w_uk.shape[1], w_uk.shape[2]
    q_lat = torch.einsum("bhtn,hnr->bhtr", q[..., :nope], w_uk)  # W_UK folded into the query
    q_cat = torch.cat((q_lat, q[..., nope:]), -1)  # [B, heads, n, rank + rope]
    scores = torch.einsum("bhtd,bld->bhtl", q_cat, latent).float() * scale
    if mask is not None:
        scores = scores + mask
    p = scores.softmax(-1).to(latent.dtype)
    o_lat = torch.einsum("bhtl,blr->bhtr", p, latent[..., :rank])  # attention output in latent space
    return torch.einsum("bhtr,hvr->bhtv", o_lat, w_uv)


class MLAAttentionBackend(TorchAttentionBackend):
    """One latent tensor `name` per layer; the model's MLA layers call `forward` below."""

    def __init__(self, pool: KVPool, name: str, scale: float, device: torch.device) -> None:
        super().__init__(pool, 1, device)
        self.name, self.scale = name, scale

    def latent_sink(self, layer: int, meta: TorchAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(pool tensor, slots) for a layer op that stores the new latents itself (the Triton
        mla_prepare, then forward(stored=True)); None: forward stores them (this backend)."""
        return None

    def absorbs_query(self, meta: TorchAttentionMetadata) -> bool:
        """Whether forward takes the decode rows' q_nope W_UK computed by the layer op (q_lat=):
        not this backend's (it absorbs in its own einsum)."""
        return False

    # The MHA contract's forward(q, k, v) has no place for a latent and the up-projections; the
    # family's attention layers call this one (the runner only ever calls init_metadata).
    def forward(self, q: torch.Tensor, latent: torch.Tensor, layer: int,  # type: ignore[override]
                meta: TorchAttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                stored: bool = False) -> torch.Tensor:
        """q: [tokens, heads, nope + rope] (q_pe rotated); latent: [tokens, rank + rope] of the
        new tokens, stored here; w_uk [heads, nope, rank], w_uv [heads, v, rank] (kv_b_proj's
        weight). Returns [tokens, heads, v]. stored: only where latent_sink said where."""
        if stored:
            raise ValueError("stored: this backend gave no latent_sink; it stores the latents itself")
        self.pool.write(layer, self.name, meta.slots, latent)
        nd = meta.num_decode
        out = q.new_empty(q.shape[0], q.shape[1], w_uv.shape[1])
        if nd:
            cached = self.pool.read_pages(layer, self.name, meta.decode_pages)  # [B, L, rank + rope]
            o = mla_absorbed(q[:nd, :, None], cached, meta.decode_mask, w_uk, w_uv, self.scale)
            out[:nd] = o[:, :, 0]
        for p in meta.prefills:
            new = latent[p.lo : p.hi]
            if p.page_table is None:
                lat, mask = new[None], None
            else:
                lat = self.pool.read_pages(layer, self.name, p.page_table)
                lat[0, p.start : p.start + p.hi - p.lo] = new  # the new tokens as handed in
                mask = p.mask
            o = mla_expanded(q[p.lo : p.hi].transpose(0, 1)[None], lat, mask, w_uk, w_uv, self.scale)
            out[p.lo : p.hi] = o[0].transpose(0, 1)
        return out
