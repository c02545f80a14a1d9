"""A decode step's query and new key put in position inside the decode attention launch.

At a step of decode rows only, head_position.py's launch (Qwen3's q / k head norms, RoPE, the
store of the new k and v into the pool) sits between the qkv product and attention, latency-bound
(~1.7 µs of a ~68 µs Qwen3 layer at bs1, docs/performance.md run 77). With DecodePosition the
decode split kernel (decode_attention.py, KETCH_DECODE_POSITION=1) takes the raw q | k | v rows:

    every program      its kv head's q heads normed (NORM) and rotated in registers, one tile
    the program whose split holds the sequence's last position (the new token)
                       that token's k head normed and rotated, stored with its v into the pool
                       (fp8 pools: clamped and cast, as kv_store does; slot < 0: nothing), then a
                       barrier, and its walk over the pages reads them back as any other row

No other program reads the new token's slot (each walks its own split's positions), so no
ordering between programs is needed. The formulas are head_position.py's per element (rmsnorm.py's
roundings, rotary.py's `rotated`), so in the interpreter the positioned q and the stored k and v
are the bits of the two launches (tests/test_decode_position.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ketch.kernels.head_position import to_fp8
from ketch.kernels.rotary import rotated


@dataclass(frozen=True)
class DecodePosition:
    """The raw new k and v heads [batch, kv_heads, dim] (any token / head strides, contiguous
    rows), cos and sin of each row's position [batch, dim] (or [batch, 1, dim]), the pool slot of
    each row [batch] (int32 / int64, < 0: padding), and Qwen3's head norms (q weight, k weight,
    eps) or None (RoPE only: Llama)."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None


@triton.jit
def positioned_rows(X, rows, stride_r, r_mask, offs_d, d_mask, Cos, Sin, W, eps,
                    HEAD_DIM: tl.constexpr, NORM: tl.constexpr, dt: tl.constexpr):
    """Rows `rows` of X (each HEAD_DIM long, stride_r apart) normed with W (NORM) and rotated by
    this token's Cos / Sin rows: [rows, BLOCK_D] in dt, head_position.py's formulas."""
    partner = (offs_d + HEAD_DIM // 2) % HEAD_DIM
    m = r_mask[:, None] & d_mask[None, :]
    base = X + rows.to(tl.int64)[:, None] * stride_r
    x = tl.load(base + offs_d[None, :], mask=m, other=0.0)
    xs = tl.load(base + partner[None, :], mask=m, other=0.0).to(tl.float32)
    c = tl.load(Cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    s = tl.load(Sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(W + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        w_p = tl.load(W + partner, mask=d_mask, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 1) / HEAD_DIM + eps)
        y = ((xf * rstd[:, None]).to(dt).to(tl.float32) * w[None, :]).to(dt)
        xs = ((xs * rstd[:, None]).to(dt).to(tl.float32) * w_p[None, :]).to(dt).to(tl.float32)
    else:
        y = x.to(dt)
    return rotated(y.to(tl.float32), xs, c[None, :], s[None, :], dt)


@triton.jit
def store_new_kv(KNew, VNew, KCache, VCache, Slots, Cos, Sin, WeightK, eps, b, kvh,
                 stride_knb, stride_knh, stride_vnb, stride_vnh, stride_ks, stride_kh, stride_vs, stride_vh,
                 offs_h, offs_d, d_mask, HEAD_DIM: tl.constexpr, NORM: tl.constexpr, TO_FP8: tl.constexpr,
                 dt: tl.constexpr):
    """Row b's new k head kvh, positioned, and its v head into their pool slot (row 0 of an
    [offs_h, BLOCK_D] tile; the other rows masked off)."""
    one = offs_h < 1
    k = positioned_rows(KNew + b * stride_knb, kvh + offs_h * 0, stride_knh, one, offs_d, d_mask, Cos, Sin,
                        WeightK, eps, HEAD_DIM, NORM, dt)
    m = one[:, None] & d_mask[None, :]
    v = tl.load(VNew + b * stride_vnb + kvh * stride_vnh + offs_h[:, None] * 0 + offs_d[None, :], mask=m, other=0.0)
    slot = tl.load(Slots + b).to(tl.int64)
    keep = m & (slot >= 0)
    k_at = KCache + tl.maximum(slot, 0) * stride_ks + kvh * stride_kh + offs_h[:, None] * 0 + offs_d[None, :]
    v_at = VCache + tl.maximum(slot, 0) * stride_vs + kvh * stride_vh + offs_h[:, None] * 0 + offs_d[None, :]
    if TO_FP8:  # scale 1.0: saturate, then round to e4m3 (head_position's store)
        tl.store(k_at, to_fp8(k, KCache.dtype.element_ty), mask=keep)
        tl.store(v_at, to_fp8(v, VCache.dtype.element_ty), mask=keep)
    else:
        tl.store(k_at, k.to(KCache.dtype.element_ty), mask=keep)
        tl.store(v_at, v.to(VCache.dtype.element_ty), mask=keep)


def check_position(position: DecodePosition, batch: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """(k, v, cos, sin) as the kernel reads them: contiguous rows, cos / sin [batch, dim]; a
    ValueError naming what does not fit."""
    k, v = position.k, position.v
    if tuple(k.shape) != (batch, kv_heads, dim) or tuple(v.shape) != (batch, kv_heads, dim):
        raise ValueError(f"position: k {tuple(k.shape)} and v {tuple(v.shape)} must be [batch, kv heads, dim] = "
                         f"{(batch, kv_heads, dim)}")
    if position.slots.shape != (batch,):
        raise ValueError(f"position: slots {tuple(position.slots.shape)} must be one per row ({batch})")
    if dim % 2:
        raise ValueError(f"head_dim: {dim} must be even for rotary embeddings")
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    cos, sin = (r.reshape(batch, dim) for r in (position.cos, position.sin))
    cos, sin = (r if r.stride(-1) == 1 else r.contiguous() for r in (cos, sin))
    return k, v, cos, sin
