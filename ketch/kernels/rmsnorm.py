"""RMSNorm and fused residual-add + RMSNorm, with ketch's numerics (ketch/layers/norm.py):

    s   = x + residual                       rounded to the activation dtype (the new residual)
    n   = s * rsqrt(mean(s^2) + eps)         statistics in fp32, n rounded to the activation dtype
    out = n * weight                         multiplied in fp32, rounded once

Rounding n before the weight is what keeps bf16 SmolLM2 (residual stream up to ~25,000) on
track; the rounding steps mirror torch's bf16 ops one for one, so only the order of the sum of
squares differs from the reference.

    grid: (rows,)  one program = one row of `hidden` elements (hidden <= 65536).

qk_rms_norm: the per-head norm of Qwen3's q and k heads (two weights) in one launch, grid
(tokens * heads,), the same math per head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ketch.kernels._common import last_dim_contiguous, pdl_launch, pow2
from ketch.kernels.rotary import rotated


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


@triton.jit
def _qk_rms_norm_kernel(
    X, WeightQ, WeightK, Out, Cos, Sin, stride_t, stride_h, stride_ot, stride_ct, stride_st, eps,
    HEADS: tl.constexpr, NUM_Q: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, ROTATE: tl.constexpr,
    USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr,
):
    """One program = one head of one token: _rms_norm_kernel's math with the q or the k weight;
    ROTATE: then the rotary embedding (rotary.py's formula) of the normed head. Its partner
    half is normed from its own loads with the same rstd, the same elementwise ops on the same
    values, so the rotation sees exactly what a separate rotary kernel would load."""
    pid = tl.program_id(0).to(tl.int64)
    t, h = pid // HEADS, pid % HEADS
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    wq = tl.load(WeightQ + offs, mask=mask, other=0.0).to(tl.float32)  # parameters: before the wait
    wk = tl.load(WeightK + offs, mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        partner = (offs + N // 2) % N
        wq_p = tl.load(WeightQ + partner, mask=mask, other=0.0).to(tl.float32)
        wk_p = tl.load(WeightK + partner, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:  # x is the qkv projection's output (cos / sin: this step's rows)
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + t * stride_t + h * stride_h + offs, mask=mask, other=0.0)
    if ROTATE:
        xs = tl.load(X + t * stride_t + h * stride_h + partner, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(Cos + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(Sin + t * stride_st + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    dt = Out.dtype.element_ty
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * rstd).to(dt).to(tl.float32)
    w = tl.where(h < NUM_Q, wq, wk)
    y = (normed * w).to(dt)
    if ROTATE:
        partner_normed = (xs * rstd).to(dt).to(tl.float32) * tl.where(h < NUM_Q, wq_p, wk_p)
        y = rotated(y.to(tl.float32), partner_normed.to(dt).to(tl.float32), c, s, dt)
    tl.store(Out + t * stride_ot + h * N + offs, y, mask=mask)


def qk_rms_norm(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                num_q: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """qk [tokens, heads, dim] (q heads, then k heads; any token stride, heads contiguous
    rows) -> a new contiguous [tokens, heads, dim]: the first num_q heads normed with q_weight,
    the rest with k_weight (Qwen3's q_norm / k_norm), in one launch where two norms and a cat ran.
    rope = (cos, sin) ([tokens, dim] or [tokens, 1, dim]): each normed head also rotated, the
    bits of rotary(qk_rms_norm(...)) in that one launch."""
    tokens, heads, dim = qk.shape
    if qk.stride(-1) != 1 or qk.stride(1) != dim:
        qk = qk.contiguous()
    out = torch.empty(tokens, heads, dim, dtype=qk.dtype, device=qk.device)
    block = pow2(dim)
    if rope is not None:
        if dim % 2:
            raise ValueError(f"head_dim: {dim} must be even for rotary embeddings")
        cos, sin = (last_dim_contiguous(r.reshape(tokens, dim)) for r in rope)
    else:
        cos = sin = out  # never read
    if tokens:
        _qk_rms_norm_kernel[(tokens * heads,)](
            qk, q_weight, k_weight, out, cos, sin, qk.stride(0), qk.stride(1), out.stride(0), cos.stride(0),
            sin.stride(0), eps, HEADS=heads, NUM_Q=num_q, N=dim, BLOCK=block, ROTATE=rope is not None,
            **pdl_launch(tokens * heads), num_warps=min(16, max(1, block // 256)))
    return out


def qk_rms_norm_ref(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                    num_q: int) -> torch.Tensor:
    return torch.cat((rms_norm_ref(qk[:, :num_q], q_weight, eps), rms_norm_ref(qk[:, num_q:], k_weight, eps)), 1)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return rms_norm_ref(s, weight, eps), s
