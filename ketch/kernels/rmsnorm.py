"""RMSNorm and fused residual-add + RMSNorm, with ketch's numerics (ketch/layers/norm.py):

    s   = x + residual                       rounded to the activation dtype (the new residual)
    n   = s * rsqrt(mean(s^2) + eps)         statistics in fp32, n rounded to the activation dtype
    out = n * weight                         multiplied in fp32, rounded once

Rounding n before the weight is what keeps bf16 SmolLM2 (residual stream up to ~25,000) on
track; the rounding steps mirror torch's bf16 ops one for one, so only the order of the sum of
squares differs from the reference.

    grid: (rows,)  one program = one row of `hidden` elements (hidden <= 65536).

Qwen3's per-head q / k norms (with RoPE and the KV store in the same launch) are in
head_position.py; qk_rms_norm_ref, their reference, is here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ketch.kernels._common import pdl_launch, pow2


@triton.jit
def _rms_norm_kernel(
    X, Residual, Weight, Out, ResidualOut,
    stride_x, stride_r, stride_o, stride_ro, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)  # a parameter: safe before the wait
    if USE_PDL:  # x / residual come from earlier kernels; ResidualOut may be what they read
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResidualOut + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * rstd).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (normed * w).to(Out.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = res_out = None
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(out)
    block = pow2(hidden)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2 if r2 is None else r2, weight, out, out if res_out is None else res_out,
            x2.stride(0), 0 if r2 is None else r2.stride(0), out.stride(0), 0 if res_out is None else res_out.stride(0),
            eps, N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, **pdl_launch(x2.shape[0]),
            num_warps=min(16, max(1, block // 256)),
        )
    res = None if res_out is None else res_out.view(x.shape)
    return out.view(x.shape), res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden]; weight: [hidden]. Same numerics as ketch.layers.norm.RMSNorm."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual) * weight, x + residual): the next sublayer's input and
    the new residual stream, in one pass over memory."""
    out, res = _launch(x, residual, weight, eps)
    assert res is not None
    return out, res


def qk_rms_norm_ref(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                    num_q: int) -> torch.Tensor:
    return torch.cat((rms_norm_ref(qk[:, :num_q], q_weight, eps), rms_norm_ref(qk[:, num_q:], k_weight, eps)), 1)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return rms_norm_ref(s, weight, eps), s
