"""The combine of the fused MoE (fused_moe.py, its third launch): out [T, k, H] -> [T, H], each
token's k weighted expert rows summed in fp32 in pick order and rounded once, as the reference's
`out.view(T, k, H).sum(1)` (fp32 accumulation, one rounding) does.

torch's reduction over the middle dimension ran as a generic reduce kernel at ~4.7 µs a layer at
bs1 on the H200 (docs/performance.md, issue 19), longer than either expert GEMM's share of a
small step; this is one short program per (token, column block).

    grid: (T, cdiv(H, BLOCK))

At a step of one token the norm after the MoE layer sums the picks itself (LayerOps.pick_rows:
norm_gemv's PICKS, the same fp32 sum in pick order and one rounding), one launch fewer;
KETCH_MOE_SUM_IN_NORM=0 turns that off (the GPU A/B's switch).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ketch.kernels._common import pdl_launch, pow2

IN_NORM = os.environ.get("KETCH_MOE_SUM_IN_NORM", "1") != "0"


@triton.jit
def _moe_sum_kernel(X, Out, stride_t, stride_k, stride_o, TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
                    BLOCK: tl.constexpr, USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    if USE_PDL:  # the rows are the down GEMM's output
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(X + t * stride_t + j * stride_k + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(Out + t * stride_o + offs, acc.to(Out.dtype.element_ty), mask=mask)


def moe_sum(x: torch.Tensor) -> torch.Tensor:
    """x [T, k, H] (last dim contiguous) -> [T, H] in x's dtype. No host sync."""
    if x.dim() != 3:
        raise ValueError(f"moe_sum: x must be [tokens, top_k, hidden], got {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    tokens, top_k, hidden = x.shape
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    block = min(1024, pow2(hidden))
    if tokens and hidden:
        _moe_sum_kernel[(tokens, triton.cdiv(hidden, block))](
            x, out, x.stride(0), x.stride(1), out.stride(0), TOP_K=top_k, HIDDEN=hidden, BLOCK=block,
            num_warps=4 if block >= 512 else 1, **pdl_launch(tokens * triton.cdiv(hidden, block)))
    return out
