"""Extend (prefill) attention over a ragged batch: each sequence has `prefix` tokens already in
the paged pool and `new` tokens whose q/k/v arrive in this step.

    grid: (ceil(max_new / BLOCK_M), heads, batch)
    one program = BLOCK_M new queries of one sequence and one q head:
        1. prefix keys [0, prefix) read through the page table, no mask (all are earlier);
        2. new keys [0, min(new, end of this query block)) read from the contiguous k/v of
           this step, causal (key j visible to query i iff j <= i).
    Online softmax in fp32 (base 2); blocks past a sequence's end do no work.

The new tokens' K/V may or may not be in the pool yet: the kernel never reads them from there.
So with an fp8 e4m3 pool (EngineConfig.kv_cache_dtype) the prefix is read as fp8, cast up to
q's dtype per tile (exact), and the new tokens attend to each other at full precision.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ketch.kernels._common import dot_precision, last_dim_contiguous, pow2
from ketch.kernels.decode_attention import LOG2E


@triton.jit
def _online_step(q, k, v, valid, m_i, l_i, acc, scale_log2, PRECISION: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


# Not specialized on per-step values (page-table width, metadata views' offsets): see decode_attention.py.
@triton.jit(do_not_specialize=["stride_pt"],
            do_not_specialize_on_alignment=["PageTable", "PrefixLens", "NewLens", "QStarts"])
def _extend_kernel(
    Q, K, V, KCache, VCache, Out, PageTable, PrefixLens, NewLens, QStarts,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cks, stride_ckh, stride_cvs, stride_cvh, stride_ot, stride_oh, stride_pt,
    scale_log2, page_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    mblk = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    kvh = h // GROUP
    n_new = tl.load(NewLens + b)
    active = mblk * BLOCK_M < n_new
    prefix = tl.where(active, tl.load(PrefixLens + b), 0)
    new_hi = tl.where(active, tl.minimum(n_new, (mblk + 1) * BLOCK_M), 0)
    q_start = tl.load(QStarts + b).to(tl.int64)

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_mask = offs_m < n_new
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < V_DIM
    rows = q_start + offs_m
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    table = PageTable + b.to(tl.int64) * stride_pt
    for start in range(0, prefix, BLOCK_N):  # cached prefix: every key is earlier than every query
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < prefix
        page = tl.load(table + offs_n // page_size, mask=n_mask, other=0).to(tl.int64)
        slot = page * page_size + offs_n % page_size
        k = tl.load(KCache + slot[:, None] * stride_cks + kvh * stride_ckh + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(VCache + slot[:, None] * stride_cvs + kvh * stride_cvh + offs_dv[None, :],
                    mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 pool's tiles, cast up exactly; else a no-op
        m_i, l_i, acc = _online_step(q, k, v, n_mask[None, :], m_i, l_i, acc, scale_log2, PRECISION)
    for start in range(0, new_hi, BLOCK_N):  # this step's tokens: causal
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < new_hi
        kv_rows = q_start + offs_n
        k = tl.load(K + kv_rows[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(V + kv_rows[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :],
                    mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        valid = n_mask[None, :] & (offs_n[None, :] <= offs_m[:, None])
        m_i, l_i, acc = _online_step(q, k, v, valid, m_i, l_i, acc, scale_log2, PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :], o.to(Out.dtype.element_ty),
             mask=m_mask[:, None] & dv_mask[None, :])


def extend_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, prefix_lens: torch.Tensor, new_lens: torch.Tensor, q_starts: torch.Tensor,
    max_new: int, scale: float, *, out: torch.Tensor | None = None, block_m: int = 64, block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """q: [tokens, heads, dim]; k: [tokens, kv_heads, dim], v: [tokens, kv_heads, v_dim] of the
    new tokens (v_dim may differ from dim: MLA's expanded form, qk 192 / v 128); sequence b owns
    rows [q_starts[b], q_starts[b] + new_lens[b]) and its first prefix_lens[b] tokens sit in the
    pool at page_table[b] ([batch, max_pages] int32). max_new >= every new_lens (sizes the grid;
    a host int, so no sync). Returns [tokens, heads, v_dim]."""
    tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    v_dim = v.shape[-1]
    if num_heads % kv_heads:
        raise ValueError(f"num_heads: {num_heads} is not a multiple of kv_heads {kv_heads}")
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    out = q.new_empty(tokens, num_heads, v_dim) if out is None else out
    batch = page_table.shape[0]
    if tokens == 0 or batch == 0 or max_new == 0:
        return out
    kc = k_cache.view(-1, kv_heads, head_dim)
    vc = v_cache.view(-1, kv_heads, v_dim)
    grid = (triton.cdiv(max_new, block_m), num_heads, batch)
    _extend_kernel[grid](
        q, k, v, kc, vc, out, page_table, prefix_lens, new_lens, q_starts,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), out.stride(0), out.stride(1), page_table.stride(0),
        scale * LOG2E, page_size,
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, V_DIM=v_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=pow2(head_dim, 16), BLOCK_DV=pow2(v_dim, 16),
        PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=2,
    )
    return out


def extend_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, prefix_lens: torch.Tensor, new_lens: torch.Tensor, q_starts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Per sequence: keys = gathered prefix ++ new k; query i sees the prefix and new keys <= i."""
    page_size, kv_heads, head_dim, v_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3], v.shape[-1]
    group = q.shape[1] // kv_heads
    out = q.new_zeros(q.shape[0], q.shape[1], v_dim)
    for b, (pre, n, q0) in enumerate(zip(prefix_lens.tolist(), new_lens.tolist(), q_starts.tolist())):
        if n == 0:
            continue
        pos = torch.arange(pre, device=q.device)
        slots = page_table[b, pos // page_size].long() * page_size + pos % page_size
        keys = torch.cat((k_cache.view(-1, kv_heads, head_dim)[slots].float(), k[q0 : q0 + n].float()))
        vals = torch.cat((v_cache.view(-1, kv_heads, v_dim)[slots].float(), v[q0 : q0 + n].float()))
        keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q0 : q0 + n].float(), keys) * scale
        visible = torch.arange(pre + n, device=q.device)[None, :] <= (pre + torch.arange(n, device=q.device))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q0 : q0 + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals).to(q.dtype)
    return out
