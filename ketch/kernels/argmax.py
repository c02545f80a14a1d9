"""The greedy pick: argmax_rows(x [B, V]) -> int64 [B], torch.argmax(x, dim=-1)'s result.

Why: at batch 1 torch's argmax over one row of a 102,400-entry vocabulary (DeepSeek-V2-Lite) ran
as a single-block reduction, 23 µs a decode step on an H100 (docs/performance.md, run 77), about
1 % of the step; two short launches spread it over the SMs.

    stage 1, grid (B, chunks): each program's BLOCK entries -> (value, index): the largest value
             and the first index holding it; a NaN is larger than everything (torch's rule:
             the first NaN wins), so a chunk with one reports its first NaN.
    stage 2, grid (B,): the chunks' pairs -> the first index of the largest (a NaN pair first).

Ties go to the lowest index, as torch.argmax documents. Any float dtype; compared in fp32
(exact for bf16 / fp16). No host sync.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ketch.kernels._common import pow2

BLOCK = 4096  # entries a stage-1 program reads: 25 programs for 102,400 logits
BIG = 2**31 - 1


@triton.jit
def _pick(vals, idx, BIG: tl.constexpr):
    """(value, index) of the first largest among (vals, idx) pairs, NaN the largest; idx BIG
    marks padding (its value is -inf)."""
    nan = vals != vals
    first_nan = tl.min(tl.where(nan, idx, BIG), axis=0)
    best = tl.max(tl.where(nan, float("-inf"), vals), axis=0)
    first_best = tl.min(tl.where((vals == best) & (idx < BIG), idx, BIG), axis=0)
    has_nan = first_nan < BIG
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first_best)


@triton.jit
def _argmax_chunk_kernel(X, Vals, Idx, V, stride_x, chunks, BLOCK: tl.constexpr, BIG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(X + row * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    # padding: index BIG, so that a row of -inf still picks a real index (its first)
    val, idx = _pick(x, tl.where(mask, offs, BIG), BIG)
    tl.store(Vals + row * chunks + c, val)
    tl.store(Idx + row * chunks + c, idx)


@triton.jit
def _argmax_merge_kernel(Vals, Idx, Out, chunks, BLOCK_C: tl.constexpr, BIG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < chunks
    vals = tl.load(Vals + row * chunks + offs, mask=mask, other=float("-inf"))
    idx = tl.load(Idx + row * chunks + offs, mask=mask, other=BIG)
    _, best = _pick(vals, idx, BIG)
    tl.store(Out + row, best.to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] (last dim contiguous) -> [B] int64: torch.argmax(x, dim=-1)."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows: x must be [rows, V > 0], got {tuple(x.shape)}")
    if x.shape[1] >= BIG:
        raise ValueError(f"argmax_rows: {x.shape[1]} entries a row do not fit int32 indices")
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, BLOCK)
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    _argmax_chunk_kernel[(rows, chunks)](x, vals, idx, vocab, x.stride(0), chunks, BLOCK=BLOCK, BIG=BIG,
                                         num_warps=8)
    _argmax_merge_kernel[(rows,)](vals, idx, out, chunks, BLOCK_C=pow2(chunks, 2), BIG=BIG, num_warps=1)
    return out
