"""MLA decode's two per-head products for a few rows, one launch each, written where they go:

    q_lat[t, h] = q_nope[t, h] @ W_UK[h]        W_UK [heads, nope, rank]   (W_UK folded into q)
    out[t, h]   = o_lat[t, h] @ W_UV[h]^T       W_UV [heads, v, rank]      (W_UV after attention)

Why: as `torch.bmm` over transposed views (ketch/attention/mla_triton_backend.py) each was a
cuBLAS batched GEMM of 3.2-3.5 µs on the H200 for 2 MB of weights at one decode row, and the
second's transposed result cost a copy kernel into the output (2.4 µs): ~9 µs of a DeepSeek-V2-Lite
bs1 layer. Here one program computes BLOCK_N outputs of one head for all rows (padded to one
tensor-core tile of 16, masked), walking K; the weight is read once, in whichever layout its
strides say (W_UK is read along its rank, W_UV along its rank too: both are [.., rank]-contiguous).

    head_gemv(x [T, H, K], w [H, K, N] as any strided view, out [T, H, N] as any strided view)
    grid: (H, cdiv(N, BLOCK_N))

fp32 accumulation, one rounding to the output dtype: equal to the bmm up to summation order.
Callers use it for decode steps of at most MAX_ROWS rows (cuBLAS is better for more).

    head_gemv(partials [1, H, S, K] fp32, w, out, lse=[1, H, S])   one row: x is merged first

The merged form takes split-K attention's partial outputs and their log-sum-exps (mla_decode's
stage 1) instead of x, and merges each head's splits as decode_attention's merge kernel does
(the same formulas: max, exp2 weights, weighted sum over the splits, divided by their sum,
rounded to the output dtype) before its product: at batch 1 the merge's own launch, 16 tiny
programs on the critical path, goes. One row only: a [splits, BLOCK_K] tile per K step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ketch.kernels._common import dot_precision, pdl_launch
from ketch.kernels.decode_attention import merge_blocks, merge_split_blocks, nonempty_splits

MAX_ROWS = 8
_ROWS_TILE = 16  # tl.dot's smallest tile


@triton.jit
def _x_tile(X, Lse, x_base, h, offs_t, t_mask, offs_k, k_mask, stride_xh, stride_xs, stride_lh, num_splits, used,
            dt: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, MERGE: tl.constexpr,
            ALL_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_T, BLOCK_K] x tile: loaded, or (MERGE, one row) row 0 merged from the splits
    (ALL_S: more of them than one tile holds, decode_attention.merge_blocks)."""
    if MERGE and ALL_S:
        acc, denom = merge_split_blocks(X + h * stride_xh, Lse + h * stride_lh, used, offs_k, k_mask,
                                        stride_xs, ALL_S, BLOCK_S, BLOCK_K)
        merged = (acc / tl.where(denom > 0, denom, 1.0)).to(dt)
        return tl.where(offs_t[:, None] == 0, merged[None, :], tl.zeros([BLOCK_T, 1], dt))
    if MERGE:
        offs_s = tl.arange(0, BLOCK_S)
        s_mask = offs_s < num_splits
        lse = tl.load(Lse + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights all 0, row 0
        w = tl.exp2(lse - m)
        denom = tl.sum(w, 0)
        o = tl.load(X + h * stride_xh + offs_s[:, None] * stride_xs + offs_k[None, :],
                    mask=s_mask[:, None] & k_mask[None, :], other=0.0)
        merged = (tl.sum(w[:, None] * o, 0) / tl.where(denom > 0, denom, 1.0)).to(dt)
        return tl.where(offs_t[:, None] == 0, merged[None, :], tl.zeros([BLOCK_T, 1], dt))
    # (in the output's dtype: both branches return one type; x and out share it wherever the
    # tile is loaded as is)
    return tl.load(x_base + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0).to(dt)


@triton.jit
def head_block(
    h, block, X, W, Out, Lse, SeqLens, rows,
    stride_xt, stride_xh, stride_wh, stride_wk, stride_wn, stride_ot, stride_oh, stride_xs, stride_lh,
    num_splits,
    K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, MERGE: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr = False, ALL_S: tl.constexpr = 0, SPLIT_BLOCK: tl.constexpr = 1,
):
    """One program's work: BLOCK_N outputs of head h for every row (also mla_prepare's absorbed
    launch, kernels/mla_prepare.py, runs it for its product programs). EARLY_TRIGGER (a one-wave
    head_gemv launch, KETCH_PDL_EARLY): the dependents launch before the wait, so the o_proj
    after W_UV requests its whole rows while this launch runs, as it does after GQA's merge."""
    h = h.to(tl.int64)
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    n_mask = offs_n < N
    t_mask = offs_t < rows
    w_base = W + h * stride_wh + offs_n[None, :] * stride_wn
    x_base = X + offs_t[:, None] * stride_xt + h * stride_xh
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    # K step 0 peeled, as in gemv: its weight tile (a parameter) is requested before the PDL
    # wait, so it streams during the previous kernel; x (that kernel's output) only after. The
    # same loads and dots in the same order as the loop: PDL on or off, the same bits.
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    if USE_PDL and EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(w_base + offs_k[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
    used = num_splits
    if MERGE and ALL_S:  # the nonempty splits' count from the row's seq len (the step's host copy)
        used = nonempty_splits(tl.load(SeqLens), num_splits, SPLIT_BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    dt = Out.dtype.element_ty
    x = _x_tile(X, Lse, x_base, h, offs_t, t_mask, offs_k, k_mask, stride_xh, stride_xs, stride_lh, num_splits,
                used, dt, BLOCK_T, BLOCK_S, MERGE, ALL_S, BLOCK_K)
    acc = tl.dot(x.to(w.dtype), w, acc, input_precision=PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_base + offs_k[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        x = _x_tile(X, Lse, x_base, h, offs_t, t_mask, offs_k, k_mask, stride_xh, stride_xs, stride_lh,
                    num_splits, used, dt, BLOCK_T, BLOCK_S, MERGE, ALL_S, BLOCK_K)
        acc = tl.dot(x.to(w.dtype), w, acc, input_precision=PRECISION)
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    out = Out + offs_t[:, None] * stride_ot + h * stride_oh + offs_n[None, :]
    tl.store(out, acc.to(dt), mask=t_mask[:, None] & n_mask[None, :])


@triton.jit
def _head_gemv_kernel(
    X, W, Out, Lse, SeqLens, rows,
    stride_xt, stride_xh, stride_wh, stride_wk, stride_wn, stride_ot, stride_oh, stride_xs, stride_lh,
    num_splits,
    K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, MERGE: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr, ALL_S: tl.constexpr = 0, SPLIT_BLOCK: tl.constexpr = 1,
):
    head_block(tl.program_id(0), tl.program_id(1), X, W, Out, Lse, SeqLens, rows,
               stride_xt, stride_xh, stride_wh, stride_wk, stride_wn, stride_ot, stride_oh, stride_xs, stride_lh,
               num_splits, K, N, BLOCK_T, BLOCK_K, BLOCK_N, BLOCK_S, MERGE, PRECISION, USE_PDL, EARLY_TRIGGER,
               ALL_S, SPLIT_BLOCK)


@dataclass(frozen=True)
class HeadGemvLaunch:
    """A checked head_gemv call, ready to launch: its output, grid and arguments (head_gemv's own
    launch, and mla_prepare's absorbed one, which runs these programs beside its own)."""
    out: torch.Tensor
    heads: int
    blocks: int  # output blocks per head
    args: tuple
    constexprs: dict[str, Any]
    num_warps: int


def plan_head_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                   lse: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None, split_block: int = 1,
                   block_k: int | None = None, block_n: int | None = None,
                   num_warps: int | None = None) -> HeadGemvLaunch:
    """head_gemv's checks and launch arguments (head_gemv's docstring); rows may be 0."""
    merge = lse is not None
    splits = 1
    if merge:
        if x.dim() != 4 or x.shape[0] != 1 or tuple(lse.shape) != tuple(x.shape[:3]) or out is None:
            raise ValueError(f"head_gemv: partials {tuple(x.shape)} and lse {tuple(lse.shape)} do not fit "
                             "(one row, an out tensor)")
        if seq_lens is None or seq_lens.numel() < 1 or split_block < 1:
            raise ValueError("head_gemv: merging needs the row's seq_lens and the split kernel's split_block")
        splits = x.shape[2]
        x_split_stride, lse_head_stride = x.stride(2), lse.stride(1)
        x = x[:, :, 0]  # [1, H, K]: the row and head strides of the partials
    else:
        x_split_stride = lse_head_stride = 0
    rows, heads, k = x.shape
    if w.shape[:2] != (heads, k) or rows > MAX_ROWS:
        raise ValueError(f"head_gemv: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (at most {MAX_ROWS} rows)")
    n = w.shape[2]
    if out is None:
        out = torch.empty((rows, heads, n), dtype=x.dtype, device=x.device)
    if x.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("head_gemv: x and out need a contiguous last dimension")
    # benchmarks/head_gemv.py on the H200 (V2-Lite's shapes, 1 row): W_UK (K 128, N 512) best at
    # 64 x 64, 4 warps (2.58 us; bmm 3.13); W_UV^T (K 512, N 128) at 256 x 16, 2 warps (2.87 us;
    # 64 x 16: 3.94; bmm + its copy 5.10)
    long_k = k >= 512
    block_k = block_k or (256 if long_k else 64)
    block_n = block_n or (64 if n >= 512 else 16)  # >= ~128 programs for MLA's shapes (16 heads)
    args = (x, w, out, lse if merge else x, seq_lens if merge else x, rows,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
            x_split_stride, lse_head_stride, splits)
    constexprs = dict(K=k, N=n, BLOCK_T=_ROWS_TILE, BLOCK_K=block_k, BLOCK_N=block_n,
                      **merge_blocks(splits, split_block),
                      MERGE=merge, PRECISION=dot_precision(out.dtype))
    return HeadGemvLaunch(out, heads, triton.cdiv(n, block_n), args, constexprs, num_warps or (2 if long_k else 4))


def head_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *, lse: torch.Tensor | None = None,
              seq_lens: torch.Tensor | None = None, split_block: int = 1, block_k: int | None = None,
              block_n: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """x [T, H, K] (T <= MAX_ROWS), w [H, K, N] (any strides: a transposed view of W_UV is fine),
    out [T, H, N] (any row / head strides, a contiguous last dim; new when None). lse [1, H, S]:
    x is split-K partials [1, H, S, K] (fp32) merged first (module docstring; `out` then names
    the dtype), of split_block-token tiles over seq_lens [1] (the split kernel's: how many splits
    hold tokens). The block sizes are benchmarks/head_gemv.py's knobs."""
    plan = plan_head_gemv(x, w, out, lse=lse, seq_lens=seq_lens, split_block=split_block, block_k=block_k,
                          block_n=block_n, num_warps=num_warps)
    if plan.args[5]:  # rows
        _head_gemv_kernel[(plan.heads, plan.blocks)](*plan.args, **plan.constexprs, num_warps=plan.num_warps,
                                                      **pdl_launch(plan.heads * plan.blocks))
    return plan.out
