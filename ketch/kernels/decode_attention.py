"""Paged decode attention (one query token per sequence), GQA-aware, split-K (flash-decoding).

    grid stage 1: (batch, kv_heads, splits)
        one program = all q heads of one kv head (rows of a [BLOCK_H, dim] tile, so each KV
        page is read once per group) over one contiguous slice of the sequence; it walks the
        slice BLOCK_N tokens at a time through the page table with an online softmax and
        writes the normalised partial output and its log-sum-exp (base 2), fp32.
    grid stage 2: (batch, heads)
        merges the splits: out = sum_s 2^(lse_s - m) * o_s / sum_s 2^(lse_s - m).
    or, fused (KETCH_DECODE_FUSED_MERGE=1), no stage 2: with one split a program writes its
        output itself; with several, each program takes a ticket (an acq_rel atomic on one
        int32 per (sequence, kv head)) after storing its partials, and the program that takes
        the last one merges its group's heads with stage 2's formula (reading past L1) and
        zeroes the ticket. Which program merges varies, the order of the sum does not: the
        same bits every run. At bs1 the merge launch was ~1.8 µs of a ~68 µs Qwen3 layer on
        the critical path (docs/performance.md, run 77).

Split s of a sequence of length L covers [s * chunk, min(L, (s + 1) * chunk)) with
chunk = ceil(ceil(L / splits) / BLOCK_N) * BLOCK_N; empty splits write lse = -inf and are
ignored by stage 2. `splits` is fixed per launch (not per sequence), so the grid depends only
on the batch size, which is what CUDA-graph capture needs; it is a runtime argument, so a new
split count does not compile a new kernel (the merge compiles once per power-of-two bound). A sequence of length 0 (a padded
row) gets zeros.

The pool may be fp8 e4m3 (EngineConfig.kv_cache_dtype): each K/V tile is cast up after its load
(exact) and the dot products run as for a pool of q's dtype, on half the bytes. With a bf16 model
they run in fp16 instead (q and the probabilities cast to fp16, fp32 accumulation): e4m3 → fp16
is one hardware conversion per pair on sm_89+, e4m3 → bf16 is not, and with the bf16 conversions
the kernel ran at the same time per token as on a bf16 pool (H200 probe: 1.9 TB/s of fp8).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ketch.kernels._common import dot_precision, last_dim_contiguous, pdl_launch, pow2
from ketch.kernels.decode_position import DecodePosition, check_position, positioned_rows, store_new_kv

LOG2E = 1.4426950408889634
# KETCH_DECODE_FUSED_MERGE=1: the split launch merges its partials (the last split of each kv head
# to finish, counted by an atomic ticket), and the merge launch goes: one launch fewer a layer
FUSED_MERGE = os.environ.get("KETCH_DECODE_FUSED_MERGE", "0") == "1"
# the fused merge's split tile: split counts up to this share one compiled variant
MERGE_SPLITS = 16
# KETCH_DECODE_POSITION=1: at a decode-only step the split launch takes the raw q | k | v and
# puts them in position itself (decode_position.py; the Triton backend's positions_decode)
POSITION = os.environ.get("KETCH_DECODE_POSITION", "0") == "1"


# Per-step values (the page-table width, the split count, where the step's metadata views start
# in its one buffer) are not specialized on: each new 1 / multiple-of-16 / alignment pattern
# would compile a kernel variant in the middle of serving (~1 s each on an H200).
@triton.jit(do_not_specialize=["stride_pt", "num_splits"], do_not_specialize_on_alignment=["PageTable", "SeqLens"])
def _decode_split_kernel(
    Q, KCache, VCache, PageTable, SeqLens, MidO, MidLse, Out, Tickets,
    KNew, VNew, Cos, Sin, WeightQ, WeightK, Slots,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cb, stride_sb,
    scale_log2, page_size, num_splits, eps,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr, FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
    POSITION: tl.constexpr, NORM: tl.constexpr, TO_FP8: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr,
):
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
    if POSITION:  # raw q | k | v rows: q normed and rotated here, the new k and v stored (decode_position.py)
        b64 = b.to(tl.int64)
        dt = Q.dtype.element_ty
        q = positioned_rows(Q + b64 * stride_qb, heads, stride_qh, h_mask, offs_d, d_mask, Cos + b64 * stride_cb,
                            Sin + b64 * stride_sb, WeightQ, eps, HEAD_DIM, NORM, dt)
        if (hi == seq_len) & (hi > lo):  # this split walks the new token's position
            store_new_kv(KNew, VNew, KCache, VCache, Slots, Cos + b64 * stride_cb, Sin + b64 * stride_sb, WeightK,
                         eps, b64, kvh, stride_knb, stride_knh, stride_vnb, stride_vnh, stride_ks, stride_kh,
                         stride_vs, stride_vh, offs_h, offs_d, d_mask, HEAD_DIM, NORM, TO_FP8, dt)
            tl.debug_barrier()  # the walk below reads that row back (its threads load other columns)
    else:
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
    hd_mask = h_mask[:, None] & d_mask[None, :]
    if FUSED_MERGE and num_splits == 1:  # the whole sequence: o is the output (the merge's bits: weight 1)
        tl.store(Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(Out.dtype.element_ty), mask=hd_mask)
    else:
        mid = MidO + b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :]
        tl.store(mid, o, mask=hd_mask)
        tl.store(MidLse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=h_mask)
        if FUSED_MERGE:
            ticket = Tickets + b * tl.num_programs(1) + kvh
            tl.debug_barrier()  # every thread's partials are stored before the release below
            if tl.atomic_add(ticket, 1, sem="acq_rel") == num_splits - 1:  # the group's last split
                tl.store(ticket, 0)  # zero again for the next launch (graph replays reuse the buffer)
                _merge_group(MidO, MidLse, Out, b.to(tl.int64), kvh, stride_mb, stride_mh, stride_ms,
                             stride_lb, stride_lh, stride_ob, stride_oh, num_splits,
                             GROUP, HEAD_DIM, BLOCK_S, BLOCK_D)


@triton.jit
def _merge_one(MidO, MidLse, b, h, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, num_splits,
               HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, CACHE: tl.constexpr):
    """One head's output from its splits' partials: sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m).
    CACHE: the loads' cache modifier, ".cg" (past L1) for partials stored by other programs of
    the same launch, "" otherwise."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"),
                  cache_modifier=CACHE)
    o = tl.load(MidO + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0, cache_modifier=CACHE)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights all 0, output 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    return tl.sum(w[:, None] * o, 0) / tl.where(denom > 0, denom, 1.0)


@triton.jit
def _merge_group(MidO, MidLse, Out, b, kvh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                 stride_ob, stride_oh, num_splits,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """The merge of one kv head's GROUP q heads, run by the split program that finished last."""
    offs_d = tl.arange(0, BLOCK_D)
    for j in tl.static_range(GROUP):  # unrolled: the heads' loads are independent, issued together
        h = kvh * GROUP + j
        out = _merge_one(MidO, MidLse, b, h, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, num_splits,
                         HEAD_DIM, BLOCK_S, BLOCK_D, ".cg")
        tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    MidO, MidLse, Out,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    if USE_PDL:  # the split kernel's partials
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    out = _merge_one(MidO, MidLse, b, h, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, num_splits,
                     HEAD_DIM, BLOCK_S, BLOCK_D, "")
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)


def num_splits_for(batch: int, kv_heads: int, max_len: int, *, block_n: int = 64,
                   target_programs: int = 264, max_splits: int = 16) -> int:
    """Enough splits to give the GPU ~target_programs programs, never a split shorter than
    two blocks (merging costs a little), at most max_splits (the scratch size)."""
    want = math.ceil(target_programs / max(1, batch * kv_heads))
    useful = math.ceil(max_len / (2 * block_n))
    return max(1, min(want, useful, max_splits))


def decode_scratch(batch: int, num_heads: int, head_dim: int, num_splits: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 outputs, fp32: partial outputs [batch, heads, splits, dim] and lse [batch, heads, splits]."""
    return (torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    *, out: torch.Tensor | None = None, scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_splits: int = 1, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
    tickets: torch.Tensor | None = None, fused_merge: bool | None = None,
    position: DecodePosition | None = None,
) -> torch.Tensor:
    """q: [batch, heads, dim]; k_cache/v_cache: [pages, page_size, kv_heads, dim] in q's dtype or fp8;
    page_table: [batch, max_pages] int32 (padding entries may be any valid page id);
    seq_lens: [batch] int32, KV length of each sequence including the current token.
    fused_merge (None: FUSED_MERGE): the splits merged by the split launch, by the last program
    of each (sequence, kv head) to finish, which `tickets` counts (int32, >= batch x kv_heads,
    zero, and zero again after the launch: decode_tickets; None allocates them); else a second
    launch merges. position (DecodePosition): q is the raw q heads, normed (position.norm) and
    rotated in this launch, which also stores the new k and v rows into the pool
    (decode_position.py). Returns [batch, heads, dim] (written into `out` when given). No host syncs."""
    batch, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads: {num_heads} is not a multiple of kv_heads {kv_heads}")
    q = last_dim_contiguous(q)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    mid_o, mid_lse = scratch if scratch is not None else decode_scratch(batch, num_heads, head_dim, num_splits, q.device)
    if mid_o.shape[0] < batch or mid_o.shape[2] != num_splits:
        raise ValueError(f"scratch: shape {tuple(mid_o.shape)} does not fit batch {batch} x {num_splits} splits")
    fused = FUSED_MERGE if fused_merge is None else fused_merge
    if fused and tickets is None:
        tickets = decode_tickets(batch, kv_heads, q.device)
    if fused and (tickets.dtype != torch.int32 or tickets.numel() < batch * kv_heads or not tickets.is_contiguous()):
        raise ValueError(f"tickets: need a contiguous int32 buffer of >= {batch * kv_heads}, got "
                         f"{tickets.dtype} {tuple(tickets.shape)}")
    kc = k_cache.view(-1, kv_heads, head_dim)
    vc = v_cache.view(-1, kv_heads, head_dim)
    group = num_heads // kv_heads
    block_d = pow2(head_dim, 16)
    if position is not None:
        k_new, v_new, cos, sin = check_position(position, batch, kv_heads, head_dim)
        wq, wk, eps = position.norm if position.norm is not None else (q, q, 0.0)
        slots = position.slots
    else:
        k_new = v_new = cos = sin = wq = wk = slots = q  # never read
        eps = 0.0
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, kc, vc, page_table, seq_lens, mid_o, mid_lse, out, tickets if fused else seq_lens,
        k_new, v_new, cos, sin, wq, wk, slots,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        cos.stride(0), sin.stride(0), scale * LOG2E, page_size, num_splits, eps,
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=pow2(group, 16), BLOCK_D=block_d, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype),
        FP16_DOTS=k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16,
        FUSED_MERGE=fused, BLOCK_S=pow2(num_splits, MERGE_SPLITS), POSITION=position is not None,
        NORM=position is not None and position.norm is not None,
        TO_FP8=k_cache.dtype == torch.float8_e4m3fn and q.dtype != k_cache.dtype,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(batch * kv_heads * num_splits),
    )
    return out if fused else merge_splits(mid_o, mid_lse, out, num_splits)


def decode_tickets(batch: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    """The fused merge's counters: one per (sequence, kv head), zero between launches."""
    return torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)


def merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, num_splits: int) -> torch.Tensor:
    """Stage 2: out [batch, heads, dim] from the partials of `num_splits` splits (also MLA's, mla_decode.py)."""
    batch, num_heads, dim = out.shape
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=dim, BLOCK_S=pow2(num_splits), BLOCK_D=pow2(dim, 16),
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
