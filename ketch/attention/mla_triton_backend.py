"""MLA (DeepSeek-V2/V3) over the paged latent pool with Triton kernels (GPU; the CPU
interpreter in tests). The math is mla_backend.py's, which stays the reference (and the CPU path).

Per layer (forward), with the step's metadata from the MHA Triton backend (triton_backend.py:
one int32 host→device copy of lens, slots and page table; decode rows first):
    store     the new latents into their slots (`store_rows`; slot < 0 = a padded graph row),
              unless the layer's mla_prepare wrote them there already (`latent_sink`)
    decode    absorbed form: q_lat = q_nope W_UK_h, `mla_decode` over the latent pages (split-K,
              a block of heads per program sharing each latent row), then W_UV_h on the
              [heads, rank] result; the two per-head products as `head_gemv` launches for steps
              of a few rows (written in place, no copy), one bmm each above that; at one row the
              W_UV head_gemv merges the splits itself (`mla_decode_partials`, `lse=`): no merge launch
    extend    expanded form, the existing `extend_attention` kernel (qk dim nope + rope, v dim
              v_head_dim, MHA: kv heads = heads): the new tokens' K/V are up-projected from the
              latents as handed in (full precision); a cached prefix is gathered by whole pages
              from the pool (`index_select`, cast up from fp8), up-projected in torch into a
              temporary paged K/V, and read through a local page table (row i = that sequence's
              gathered pages). Exactly what mla_backend.py computes, with one kernel launch for
              every extend chunk of the step instead of a Python loop.

Cost of the expanded prefix: O(prefix x heads x (nope + v) x rank) FLOPs and a transient
[prefix pages x page_size, heads, nope + rope | v] K/V per layer, as in the torch reference;
an absorbed-form extend over the prefix would avoid it (not done: prefix hits are rarer than
decode steps, and this path reuses a tested kernel).

Steps with an extend chunk after a cached prefix make one more small host→device copy (the
gathered page ids and the local table). Decode steps are exactly the MHA backend's: the same
metadata and the same decode-graph hooks (inherited), with the split-K scratch sized for
[heads, kv_lora_rank] partials; the short shape's tile is SHORT_BLOCK_N latent rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ketch.attention.triton_backend import (
    DecodeMetadata,
    ExtendMetadata,
    TritonAttentionBackend,
    TritonAttentionMetadata,
)
from ketch.cache.kv_pool import KVPool
from ketch.forward_batch import ForwardBatch
from ketch.host_copy import to_device
from ketch.kernels._common import interpreting
from ketch.kernels.extend_attention import extend_attention
from ketch.kernels.head_gemv import MAX_ROWS as HEAD_GEMV_MAX_ROWS
from ketch.kernels.head_gemv import head_gemv
from ketch.kernels.kv_store import store_rows
from ketch.kernels.mla_decode import mla_decode, mla_decode_partials, mla_num_splits


@dataclass
class MLAExtendMetadata(ExtendMetadata):
    prefix_pages: torch.Tensor | None = None  # [n] int32: every extend chunk's cached-prefix pages, in order
    prefix_table: torch.Tensor | None = None  # [extend batch, max prefix pages] int32 rows into them


def expand(lat: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents [..., rank + rope] -> per-head K [..., heads, nope + rope], V [..., heads, v]."""
    rank = w_uk.shape[2]
    c, k_pe = lat[..., :rank], lat[..., rank:]
    k_nope = torch.einsum("...r,hnr->...hn", c, w_uk)
    k = torch.cat((k_nope, k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], k_pe.shape[-1])), -1)
    return k, torch.einsum("...r,hvr->...hv", c, w_uv)


# Decode defaults (read when a backend is built: GPU sweeps set them through scripts/with_constants.py):
# latent rows per split step, and the most splits of a sequence
DECODE_BLOCK_N = 32
MAX_SPLITS = 64
# the short shape's tile (triton_backend.SHORT_SPAN): 16 rows put less on each split's critical
# path; a long context's splits hold several tiles, where 32 is faster (runs 93, 109)
SHORT_BLOCK_N = 16


class MLATritonBackend(TritonAttentionBackend):
    """The model's MLA layers call `forward(q, latent, layer, meta, w_uk, w_uv)` (mla_backend.py's)."""

    def __init__(self, pool: KVPool, name: str, num_heads: int, kv_lora_rank: int, scale: float,
                 device: torch.device, *, decode_block_h: int = 16, decode_block_n: int | None = None,
                 decode_splits: int | None = None, max_splits: int | None = None, decode_splits_len: int | None = None,
                 extend_block_m: int = 64, extend_block_n: int = 32, extend_warps: int = 8) -> None:
        # not the MHA __init__: the pool has no k/v, and the head dim of the decode scratch is the rank
        self.device = torch.device(device)
        if self.device.type != "cuda" and not interpreting():
            raise ValueError(f"attention_backend: 'triton' needs a CUDA device (or TRITON_INTERPRET=1), got {self.device}")
        if decode_splits is not None and decode_splits < 1:
            raise ValueError(f"decode_splits: must be >= 1, got {decode_splits}")
        self.pool, self.name, self.page_size = pool, name, pool.page_size
        self.num_heads, self.head_dim, self.scale = num_heads, kv_lora_rank, scale
        self.decode_block_h, self.decode_block_n = decode_block_h, decode_block_n or DECODE_BLOCK_N
        self.decode_splits, self.decode_splits_len = decode_splits, decode_splits_len
        self.max_splits = max_splits or MAX_SPLITS
        self.init_short_shape(min(SHORT_BLOCK_N, self.decode_block_n))
        self.extend_block_m, self.extend_block_n, self.extend_warps = extend_block_m, extend_block_n, extend_warps
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 132
        self.target_programs = 2 * sms
        self.graph_buffers = None

    def split_count(self, batch: int, span: int, block_n: int, min_blocks: int = 2) -> int:
        return mla_num_splits(batch, self.num_heads, span, block_h=self.decode_block_h, block_n=block_n,
                              target_programs=self.target_programs, max_splits=self.max_splits, min_blocks=min_blocks)

    def init_metadata(self, batch: ForwardBatch) -> TritonAttentionMetadata:
        meta = super().init_metadata(batch)
        e, nd = meta.extend, batch.num_decode
        if e is None:
            return meta
        used = -(-batch.starts[nd:] // self.page_size)  # pages of each chunk's cached prefix
        prefix_pages = prefix_table = None
        if used.any():
            width = int(used.max())
            cols = np.arange(width)[None, :]
            pages = batch.page_table[nd:, :width][cols < used[:, None]]  # row-major: chunk by chunk
            first = np.cumsum(used) - used
            table = np.minimum(first[:, None] + cols, len(pages) - 1)  # past a row's pages: never read
            buf = to_device(np.concatenate((pages, table.ravel())).astype(np.int32), self.device)
            prefix_pages, prefix_table = buf[: len(pages)], buf[len(pages) :].view(len(used), width)
        meta.extend = MLAExtendMetadata(e.page_table, e.prefix_lens, e.new_lens, e.q_starts, e.max_new,
                                        prefix_pages, prefix_table)
        return meta

    def latent_sink(self, layer: int, meta: TritonAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the new latents go (the layer's pool tensor, the step's slots): the Triton
        mla_prepare writes them there in its launch, and forward(stored=True) skips store_rows."""
        return self.pool.tensor(layer, self.name), meta.slots

    def absorbs_query(self, meta: TritonAttentionMetadata) -> bool:
        """Whether forward takes q_lat = q_nope W_UK of the step made by the layer op (the Triton
        mla_prepare_absorb: the product's programs beside the prepare's, one launch): a step of
        decode rows only, few enough for head_gemv."""
        return meta.extend is None and meta.decode is not None and meta.num_decode <= HEAD_GEMV_MAX_ROWS

    def forward(self, q: torch.Tensor, latent: torch.Tensor, layer: int,  # type: ignore[override]
                meta: TritonAttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                stored: bool = False, q_lat: torch.Tensor | None = None) -> torch.Tensor:
        """As MLAAttentionBackend.forward: q [tokens, heads, nope + rope] (q_pe rotated), latent
        [tokens, rank + rope]; w_uk [heads, nope, rank], w_uv [heads, v, rank]. Returns [tokens, heads, v].
        stored: the latents are in the pool already (latent_sink); q_lat: the decode rows' q_nope
        W_UK, made already (absorbs_query)."""
        cache = self.pool.tensor(layer, self.name)
        if not stored:
            store_rows(cache, latent, meta.slots)
        out = q.new_empty(q.shape[0], q.shape[1], w_uv.shape[1])
        if meta.decode is not None:
            self._decode(q[: meta.num_decode], cache, meta.decode, w_uk, w_uv, out[: meta.num_decode], q_lat)
        if meta.extend is not None:
            self._extend(q, latent, cache, meta.extend, w_uk, w_uv, out)
        return out

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, d: DecodeMetadata, w_uk: torch.Tensor,
                w_uv: torch.Tensor, out: torch.Tensor, q_lat: torch.Tensor | None) -> None:
        """The decode rows, absorbed: q_lat = q_nope W_UK (unless given), split-K MLA over the
        latent cache, W_UV."""
        nd, nope = q.shape[0], w_uk.shape[1]
        few = nd <= HEAD_GEMV_MAX_ROWS  # a few rows: one launch per product, no copy (kernels/head_gemv.py)
        if q_lat is None:
            q_lat = head_gemv(q[:, :, :nope], w_uk) if few else \
                torch.bmm(q[:, :, :nope].transpose(0, 1), w_uk).transpose(0, 1)  # [nd, heads, rank]
        splits = dict(scratch=d.scratch, num_splits=d.num_splits, block_h=self.decode_block_h,
                      block_n=d.block_n)
        if nd == 1:  # the W_UV product merges the splits itself: the merge's launch goes
            parts, lse = mla_decode_partials(q_lat, q[:, :, nope:], cache, d.page_table, d.seq_lens, self.scale,
                                             **splits)
            head_gemv(parts, w_uv.transpose(1, 2), out=out, lse=lse, seq_lens=d.seq_lens,
                      split_block=splits["block_n"])
            return
        o_lat = mla_decode(q_lat, q[:, :, nope:], cache, d.page_table, d.seq_lens, self.scale, **splits)
        if few:
            head_gemv(o_lat, w_uv.transpose(1, 2), out=out)
        else:
            out.copy_(torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1))

    def _extend(self, q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor, e: ExtendMetadata,
                w_uk: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor) -> None:
        """The extend rows (after the decode rows): expanded K / V (the decode rows' too, never
        read: one GEMM, no row offsets), the extend kernel."""
        k, v = expand(latent, w_uk, w_uv)
        if e.prefix_pages is not None:
            kc, vc = expand(cache.index_select(0, e.prefix_pages).to(q.dtype), w_uk, w_uv)
            table = e.prefix_table
        else:  # nothing cached before any chunk: the kernel's prefix loop never runs
            kc, vc, table = k[:0, None], v[:0, None], e.page_table
        extend_attention(q, k, v, kc, vc, table, e.prefix_lens, e.new_lens, e.q_starts, e.max_new, self.scale,
                         out=out, block_m=self.extend_block_m, block_n=self.extend_block_n,
                         num_warps=self.extend_warps)
