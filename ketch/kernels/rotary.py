"""Rotary embedding in ketch's layout (ketch/layers/rotary.py): full-width cos and signed sin
rows (sin = [-sin | sin]), rotate-half (NeoX) pairing, so

    out[d] = x[d] * cos[d] + x[(d + D/2) % D] * sin[d]

Each product is rounded to the activation dtype before the sum, as torch's bf16 ops do, so the
result matches `apply_rotary` bit for bit up to fp32 fused multiply-add differences (the layer's
function is the reference; tests/test_kernels.py takes it from there: a kernel does not import layers/).

    grid: (tokens,)  one program = every head of one token (q and k heads of a fused q|k
    tensor in one launch), sharing that token's cos/sin row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ketch.kernels._common import last_dim_contiguous, pdl_launch, pow2


@triton.jit
def rotated(x, x_partner, cos, sin, dt: tl.constexpr):
    """x * cos + x_partner * sin (fp32 operands) with each product rounded to `dt` before the sum,
    as torch's bf16 ops round; the sum rounded to `dt`. Shared with kernels/mla_prepare.py."""
    a = (x * cos).to(dt).to(tl.float32)
    b = (x_partner * sin).to(dt).to(tl.float32)
    return (a + b).to(dt)


@triton.jit
def _rotary_kernel(
    X, Cos, Sin, Out,
    stride_xt, stride_xh, stride_ct, stride_st, stride_ot, stride_oh,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    mask = (offs_h[:, None] < HEADS) & d_mask[None, :]
    partner = (offs_d + HEAD_DIM // 2) % HEAD_DIM
    base = X + t * stride_xt + offs_h[:, None] * stride_xh
    if USE_PDL:  # x (often rotated in place), cos and sin are all written during the step
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xs = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    c = tl.load(Cos + t * stride_ct + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    s = tl.load(Sin + t * stride_st + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    out = rotated(x, xs, c[None, :], s[None, :], Out.dtype.element_ty)
    tl.store(Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], out, mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [tokens, heads, dim] (token/head strides free, e.g. a view into fused qkv);
    cos, sin: [tokens, dim] or [tokens, 1, dim] (RotaryEmbedding.lookup). `out` may be `x`."""
    tokens, heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"head_dim: {head_dim} must be even for rotary embeddings")
    x = last_dim_contiguous(x)
    cos = last_dim_contiguous(cos.reshape(tokens, head_dim))
    sin = last_dim_contiguous(sin.reshape(tokens, head_dim))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if tokens:
        _rotary_kernel[(tokens,)](
            x, cos, sin, out,
            x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
            HEADS=heads, HEAD_DIM=head_dim, BLOCK_H=pow2(heads), BLOCK_D=pow2(head_dim),
            num_warps=4 if heads * head_dim >= 2048 else 2, **pdl_launch(tokens),
        )
    return out
