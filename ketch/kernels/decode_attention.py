"""Paged decode attention (one query token per sequence), GQA-aware, split-K (flash-decoding).

    grid stage 1: (batch, kv_heads, splits)
        one program = all q heads of one kv head (rows of a [BLOCK_H, dim] tile, so each KV
        page is read once per group) over one contiguous slice of the sequence; it walks the
        slice BLOCK_N tokens at a time through the page table with an online softmax and
        writes the normalised partial output and its log-sum-exp (base 2), fp32.
    grid stage 2: (batch, heads)
        merges the splits: out = sum_s 2^(lse_s - m) * o_s / sum_s 2^(lse_s - m).
    One split (a large batch, or a short context): stage 1 writes out itself and stage 2 is not
    launched; the merge of one split weighs it 2^0 / 2^0, so the output is bit-identical.

Split s of a sequence of length L covers [s * chunk, min(L, (s + 1) * chunk)) with
chunk = ceil(ceil(L / splits) / BLOCK_N) * BLOCK_N; empty splits write lse = -inf and are
ignored by stage 2 (past MERGE_BLOCK splits they write nothing else, and stage 2 reads only the
nonempty ones, which are a prefix). `splits` is fixed per launch (not per sequence), so the grid
depends only on the batch size, which is what CUDA-graph capture needs; it is a runtime argument,
so a new split count does not compile a new kernel (the merge compiles once per power-of-two
bound). A sequence of length 0 (a padded row) gets zeros.

The pool may be fp8 e4m3 (EngineConfig.kv_cache_dtype): each K/V tile is cast up after its load
(exact) and the dot products run as for a pool of q's dtype, on half the bytes. With a bf16 model
they run in fp16 instead (q and the probabilities cast to fp16, fp32 accumulation): e4m3 → fp16
is one hardware conversion per pair on sm_89+, e4m3 → bf16 is not, and with the bf16 conversions
the kernel ran at the same time per token as on a bf16 pool (H200 probe: 1.9 TB/s of fp8).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ketch.kernels._common import dot_precision, last_dim_contiguous, pdl_launch, pow2

LOG2E = 1.4426950408889634


# Per-step values (the page-table width, the split count, where the step's metadata views start
# in its one buffer) are not specialized on: each new 1 / multiple-of-16 / alignment pattern
# would compile a kernel variant in the middle of serving (~1 s each on an H200).
@triton.jit(do_not_specialize=["stride_pt", "num_splits"], do_not_specialize_on_alignment=["PageTable", "SeqLens"])
def _decode_split_kernel(
    Q, KCache, VCache, PageTable, SeqLens, MidO, MidLse,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    scale_log2, page_size, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr, SKIP_EMPTY: tl.constexpr = False, DIRECT: tl.constexpr = False,
):
    """DIRECT (one split): MidO is the output [batch, heads, dim] in its dtype, MidLse unused."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:  # q, seq_lens, the page table and the KV just stored are all this step's
        if EARLY_TRIGGER:  # a one-wave grid (bs1): the kernels after it launch and stream their weights
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq_len = tl.load(SeqLens + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if FP16_DOTS:
        q = q.to(tl.float16)
    table = PageTable + b.to(tl.int64) * stride_pt

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        page = tl.load(table + offs_n // page_size, mask=n_mask, other=0).to(tl.int64)
        slot = page * page_size + offs_n % page_size
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(KCache + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        k = k.to(q.dtype)  # an fp8 pool's tile, cast up exactly; a no-op when the pool is q's dtype
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VCache + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()

    nonempty = hi > lo
    o = tl.where(nonempty, acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    mid = MidO + b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :]
    o_mask = h_mask[:, None] & d_mask[None, :]
    if SKIP_EMPTY:  # past MERGE_BLOCK splits the consumers read only the nonempty ones (merge_splits)
        o_mask = o_mask & nonempty
    tl.store(mid, o.to(MidO.dtype.element_ty), mask=o_mask)
    if not DIRECT:
        tl.store(MidLse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def nonempty_splits(seq_len, num_splits, SPLIT_BLOCK: tl.constexpr):
    """How many of a sequence's splits hold tokens (a prefix of them): the split kernels' chunking
    (chunk = ceil(ceil(L / splits) / SPLIT_BLOCK) * SPLIT_BLOCK); 0 for a padded row (L = 0)."""
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), SPLIT_BLOCK) * SPLIT_BLOCK
    return tl.where(seq_len > 0, tl.cdiv(seq_len, tl.maximum(chunk, 1)), 0)


@triton.jit
def merge_split_blocks(MidO, MidLse, used, offs_d, d_mask, stride_ms,
                       ALL_S: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """More splits than one tile holds (MERGE_BLOCK): sum_s 2^(lse_s - m) * o_s and its weights
    over the `used` nonempty splits only (nonempty_splits: the consumers take the count from the
    sequence's length, before their PDL wait), BLOCK_S at a time; the rest wrote no partial
    (SKIP_EMPTY). The lse of all of them and the first block's partials are requested together,
    one round trip: a short context needs no more. MidO / MidLse: this head's rows.
    Returns (the weighted sum [BLOCK_D], the sum of the weights), fp32."""
    offs_a = tl.arange(0, ALL_S)
    lse_all = tl.load(MidLse + offs_a, mask=offs_a < used, other=float("-inf"))
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < used
    lse = tl.load(MidLse + offs_s, mask=s_mask, other=float("-inf"))
    o = tl.load(MidO + offs_s[:, None] * stride_ms + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m = tl.max(lse_all, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights all 0, output 0
    w = tl.exp2(lse - m)
    acc = tl.sum(w[:, None] * o, 0)
    denom = tl.sum(w, 0)
    for s0 in range(BLOCK_S, used, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < used
        w = tl.exp2(tl.load(MidLse + offs_s, mask=s_mask, other=float("-inf")) - m)
        o = tl.load(MidO + offs_s[:, None] * stride_ms + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                    other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        denom += tl.sum(w, 0)
    return acc, denom


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    MidO, MidLse, Out, SeqLens,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr, ALL_S: tl.constexpr = 0, SPLIT_BLOCK: tl.constexpr = 1,
):
    """ALL_S 0: every split in one [BLOCK_S, BLOCK_D] tile; else the splits' power-of-two bound,
    merged BLOCK_S at a time over the nonempty ones (merge_split_blocks; SPLIT_BLOCK: the split
    kernel's BLOCK_N, for their count)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    if ALL_S:  # the step's seq lens: its host copy, before every kernel of the step (README rules)
        used = nonempty_splits(tl.load(SeqLens + b), num_splits, SPLIT_BLOCK)
    if USE_PDL:  # the split kernel's partials
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if ALL_S:
        acc, denom = merge_split_blocks(MidO + b * stride_mb + h * stride_mh, MidLse + b * stride_lb + h * stride_lh,
                                        used, offs_d, d_mask, stride_ms, ALL_S, BLOCK_S, BLOCK_D)
        if USE_PDL and not EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    else:
        lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights all 0, output 0
        w = tl.exp2(lse - m)
        o = tl.load(MidO + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        if USE_PDL and not EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        denom = tl.sum(w, 0)
        acc = tl.sum(w[:, None] * o, 0)
    out = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


def num_splits_for(batch: int, kv_heads: int, max_len: int, *, block_n: int = 64,
                   target_programs: int = 264, max_splits: int = 16, min_blocks: int = 2) -> int:
    """Enough splits to give the GPU ~target_programs programs, never a split shorter than
    min_blocks blocks (merging costs a little), at most max_splits (the scratch size)."""
    want = math.ceil(target_programs / max(1, batch * kv_heads))
    useful = math.ceil(max_len / (min_blocks * block_n))
    return max(1, min(want, useful, max_splits))


def decode_scratch(batch: int, num_heads: int, head_dim: int, num_splits: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 outputs, fp32: partial outputs [batch, heads, splits, dim] and lse [batch, heads, splits]."""
    return (torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device))


# The split kernel's launch shape (None in a call: these, read at call time, so that a GPU sweep
# can set them through scripts/with_constants.py)
SPLIT_WARPS = 4
SPLIT_STAGES = 2
# The splits a consumer merges in one tile: up to this many, all of them at once (empty ones
# weigh 0); past it (a long context at a small batch may want more splits than 16: MAX_SPLITS in
# the attention backends) the nonempty ones only, this many at a time.
MERGE_BLOCK = 16
# One split is written by the split kernel itself; True merges it as any other count (the A/B's base)
MERGE_ONE_SPLIT = False


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    *, out: torch.Tensor | None = None, scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_splits: int = 1, block_n: int = 64, num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:
    """q: [batch, heads, dim]; k_cache/v_cache: [pages, page_size, kv_heads, dim] in q's dtype or fp8;
    page_table: [batch, max_pages] int32 (padding entries may be any valid page id);
    seq_lens: [batch] int32, KV length of each sequence including the current token.
    Returns [batch, heads, dim] (written into `out` when given). No host syncs."""
    batch, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads: {num_heads} is not a multiple of kv_heads {kv_heads}")
    q = last_dim_contiguous(q)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    direct = num_splits == 1 and not MERGE_ONE_SPLIT  # the split's normalised output is the merge's: no merge
    if direct:
        mid_o, mid_lse = out.unsqueeze(2), out  # [batch, heads, 1, dim]; no lse is written
    else:
        mid_o, mid_lse = scratch if scratch is not None else decode_scratch(batch, num_heads, head_dim, num_splits,
                                                                            q.device)
        if mid_o.shape[0] < batch or mid_o.shape[2] != num_splits:
            raise ValueError(f"scratch: shape {tuple(mid_o.shape)} does not fit batch {batch} x {num_splits} splits")
    kc = k_cache.view(-1, kv_heads, head_dim)
    vc = v_cache.view(-1, kv_heads, head_dim)
    group = num_heads // kv_heads
    block_d = pow2(head_dim, 16)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, kc, vc, page_table, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        scale * LOG2E, page_size, num_splits,
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=pow2(group, 16), BLOCK_D=block_d, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype),
        FP16_DOTS=k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16,
        num_warps=num_warps or SPLIT_WARPS, num_stages=num_stages or SPLIT_STAGES, SKIP_EMPTY=skips_empty(num_splits),
        DIRECT=direct, **pdl_launch(batch * kv_heads * num_splits),
    )
    return out if direct else merge_splits(mid_o, mid_lse, out, num_splits, seq_lens, block_n)


def skips_empty(num_splits: int) -> bool:
    """Past MERGE_BLOCK splits the split kernels store no partial for an empty split and the
    consumers read the nonempty ones only, MERGE_BLOCK at a time; up to it, one tile of all."""
    return num_splits > MERGE_BLOCK


def merge_blocks(num_splits: int, split_block: int) -> dict[str, int]:
    """The merge's tile constexprs: BLOCK_S, ALL_S (0: one tile of every split) and the split
    kernel's block (SPLIT_BLOCK: the consumers count the nonempty splits from the seq lens)."""
    if skips_empty(num_splits):
        return {"BLOCK_S": MERGE_BLOCK, "ALL_S": pow2(num_splits), "SPLIT_BLOCK": split_block}
    return {"BLOCK_S": pow2(num_splits), "ALL_S": 0, "SPLIT_BLOCK": split_block}


def merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, num_splits: int,
                 seq_lens: torch.Tensor, split_block: int) -> torch.Tensor:
    """Stage 2: out [batch, heads, dim] from the partials of `num_splits` splits of split_block-
    token tiles over seq_lens [batch] (also MLA's, mla_decode.py)."""
    batch, num_heads, dim = out.shape
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=dim, BLOCK_D=pow2(dim, 16), **merge_blocks(num_splits, split_block),
        num_warps=1 if dim <= 64 else (2 if dim <= 128 else 4), **pdl_launch(batch * num_heads),
    )
    return out


def decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Per sequence: gather its first seq_len slots through the page table, softmax in fp32."""
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.zeros_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = page_table[b, pos // page_size].long() * page_size + pos % page_size
        k = k_cache.view(-1, kv_heads, k_cache.shape[3])[slots].float().repeat_interleave(group, 1)  # [n, heads, dim]
        v = v_cache.view(-1, kv_heads, v_cache.shape[3])[slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
