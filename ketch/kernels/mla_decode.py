"""Paged MLA decode (DeepSeek-V2/V3 multi-head latent attention), absorbed form, split-K.

The pool holds one latent row per token, [rank + rope] = c_kv | k_pe, shared by every head.
With W_UK folded into the query by the caller (q_lat = q_nope W_UK_h, [heads, rank]) and q_pe
the rotated rope part, per head h and cached token j:

    score[h, j] = (q_lat[h] · c[j] + q_pe[h] · k_pe[j]) * scale      (key = the whole row)
    out[h]      = softmax_j(score[h]) · c                             (value = the c part)

The output stays in the latent space ([heads, rank]); the caller applies W_UV per head. All
heads read the same K/V (MQA with head dim rank + rope), so one program takes a block of
BLOCK_H heads and each latent row it loads serves all of them (tl.dot [BLOCK_H, rank] x
[rank, BLOCK_N]): the cache is read once per head block instead of once per head.

    grid stage 1: (batch, cdiv(heads, BLOCK_H), splits)   online softmax over one slice of the
                  sequence, BLOCK_N tokens at a time through the page table; writes the
                  normalised partial [BLOCK_H, rank] and its log-sum-exp (base 2), fp32
    grid stage 2: (batch, heads)   decode_attention's merge (`merge_splits`)

Splits, empty splits, padded rows (seq_len 0 -> zeros), fp8 pools (each tile cast up to q's
dtype; fp16 dots with a bf16 model) and PDL are exactly as in decode_attention.py, whose
scratch layout ([batch, heads, splits, dim] with dim = rank) this reuses. sm_scale comes from
the caller (DeepSeek: qk_head_dim^-0.5 times YaRN's mscale^2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ketch.kernels._common import dot_precision, last_dim_contiguous, pdl_launch, pow2
from ketch.kernels.decode_attention import LOG2E, decode_scratch, merge_splits, num_splits_for, skips_empty


# The split kernel's launch shape when a call gives none (read at call time: GPU sweeps set them
# through scripts/with_constants.py)
SPLIT_WARPS = 4
SPLIT_STAGES = 2


# Per-step values are not specialized on (a new page-table width or split count would compile
# a variant mid-serving): see decode_attention.py.
@triton.jit(do_not_specialize=["stride_pt", "num_splits"], do_not_specialize_on_alignment=["PageTable", "SeqLens"])
def _mla_decode_split_kernel(
    QLat, QPe, Cache, PageTable, SeqLens, MidO, MidLse,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_cs, stride_pt,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    scale_log2, page_size, num_splits,
    HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr, SKIP_EMPTY: tl.constexpr = False,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:  # q, seq_lens, the page table and the latent just stored are all this step's
        if EARLY_TRIGGER:  # a one-wave grid (bs1): the kernels after it launch and stream their weights
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq_len = tl.load(SeqLens + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    h_mask = heads < HEADS
    r_mask = offs_r < RANK
    p_mask = offs_p < ROPE
    b64 = b.to(tl.int64)
    q_lat = tl.load(QLat + b64 * stride_qlb + heads[:, None] * stride_qlh + offs_r[None, :],
                    mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(QPe + b64 * stride_qpb + heads[:, None] * stride_qph + offs_p[None, :],
                   mask=h_mask[:, None] & p_mask[None, :], other=0.0)
    if FP16_DOTS:
        q_lat, q_pe = q_lat.to(tl.float16), q_pe.to(tl.float16)
    table = PageTable + b64 * stride_pt

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        page = tl.load(table + offs_n // page_size, mask=n_mask, other=0).to(tl.int64)
        row = Cache + (page * page_size + offs_n % page_size)[:, None] * stride_cs
        c = tl.load(row + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(q_lat.dtype)
        k_pe = tl.load(row + RANK + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0).to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        s = (s + tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)) * scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)  # values: the c part
        m_i = m_new
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()

    nonempty = hi > lo
    o = tl.where(nonempty, acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    mid = MidO + b64 * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_r[None, :]
    o_mask = h_mask[:, None] & r_mask[None, :]
    if SKIP_EMPTY:  # past MERGE_BLOCK splits the consumers read only the nonempty ones
        o_mask = o_mask & nonempty
    tl.store(mid, o, mask=o_mask)
    tl.store(MidLse + b64 * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


def mla_num_splits(batch: int, heads: int, max_len: int, *, block_h: int = 16, block_n: int = 32,
                   target_programs: int = 264, max_splits: int = 16, min_blocks: int = 2) -> int:
    """decode_attention's rule with a program per (sequence, head block, split)."""
    return num_splits_for(batch, triton.cdiv(heads, block_h), max_len, block_n=block_n,
                          target_programs=target_programs, max_splits=max_splits, min_blocks=min_blocks)


def mla_decode(
    q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None, num_splits: int = 1,
    block_h: int = 16, block_n: int = 32, num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:
    """q_lat: [batch, heads, rank] (W_UK folded in); q_pe: [batch, heads, rope] (rotated);
    cache: [pages, page_size, rank + rope] in q's dtype or fp8; page_table [batch, max_pages]
    int32; seq_lens [batch] int32 (this step's token included). Returns [batch, heads, rank]
    in q's dtype (into `out` when given). No host syncs."""
    batch, heads, rank = q_lat.shape
    out = q_lat.new_empty(batch, heads, rank) if out is None else out
    if batch == 0:
        return out
    mid_o, mid_lse = mla_decode_partials(q_lat, q_pe, cache, page_table, seq_lens, scale, scratch=scratch,
                                         num_splits=num_splits, block_h=block_h, block_n=block_n,
                                         num_warps=num_warps, num_stages=num_stages)
    return merge_splits(mid_o, mid_lse, out, num_splits, seq_lens, block_n)


def mla_decode_partials(
    q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, *, scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_splits: int = 1, block_h: int = 16, block_n: int = 32, num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 alone: (partials [batch, heads, splits, rank], lse [batch, heads, splits]), fp32,
    views of the scratch, for a consumer that merges them itself (head_gemv(lse=): the W_UV
    product at batch 1, the merge's launch saved)."""
    batch, heads, rank = q_lat.shape
    rope = q_pe.shape[2]
    page_size, width = cache.shape[1], cache.shape[2]
    if width != rank + rope:
        raise ValueError(f"cache: rows of {width}, expected rank {rank} + rope {rope}")
    q_lat, q_pe = last_dim_contiguous(q_lat), last_dim_contiguous(q_pe)
    mid_o, mid_lse = scratch if scratch is not None else decode_scratch(batch, heads, rank, num_splits, q_lat.device)
    if mid_o.shape[0] < batch or mid_o.shape[2] != num_splits or mid_o.shape[3] != rank:
        raise ValueError(f"scratch: shape {tuple(mid_o.shape)} does not fit batch {batch} x {num_splits} splits x {rank}")
    if batch == 0:
        return mid_o[:0], mid_lse[:0]
    c = cache.view(-1, width)
    _mla_decode_split_kernel[(batch, triton.cdiv(heads, block_h), num_splits)](
        q_lat, q_pe, c, page_table, seq_lens, mid_o, mid_lse,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), c.stride(0), page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        scale * LOG2E, page_size, num_splits,
        HEADS=heads, RANK=rank, ROPE=rope,
        BLOCK_H=block_h, BLOCK_R=pow2(rank, 16), BLOCK_P=pow2(rope, 16), BLOCK_N=block_n,
        PRECISION=dot_precision(q_lat.dtype),
        FP16_DOTS=cache.dtype == torch.float8_e4m3fn and q_lat.dtype == torch.bfloat16,
        num_warps=num_warps or SPLIT_WARPS, num_stages=num_stages or SPLIT_STAGES, SKIP_EMPTY=skips_empty(num_splits),
        **pdl_launch(batch * triton.cdiv(heads, block_h) * num_splits),
    )
    return mid_o[:batch], mid_lse[:batch]


def mla_decode_ref(
    q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Per sequence: gather its first seq_len latent rows, score against q_lat | q_pe, softmax
    in fp32, weighted sum of the c part."""
    page_size, rank = cache.shape[1], q_lat.shape[2]
    rows = cache.view(-1, cache.shape[2])
    out = torch.zeros_like(q_lat)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n, device=q_lat.device)
        lat = rows[page_table[b, pos // page_size].long() * page_size + pos % page_size].float()  # [n, rank + rope]
        scores = (q_lat[b].float() @ lat[:, :rank].T + q_pe[b].float() @ lat[:, rank:].T) * scale
        out[b] = (scores.softmax(-1) @ lat[:, :rank]).to(q_lat.dtype)
    return out
