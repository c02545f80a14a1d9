"""KV store: write the new tokens' K and V rows (or, `store_rows`, MLA's one latent row) into the paged pool.

Slot of a token = page_table[pos // page_size] * page_size + pos % page_size (computed once
per step by the attention backend). A negative slot means "padding, write nothing", so a
CUDA-graph runner can pad a batch without a scratch page.

An fp8 e4m3 pool (EngineConfig.kv_cache_dtype) stores with scale 1.0: each value is clamped
to [-448, 448] in fp32 and cast (round to nearest even), exactly as KVPool.store does in torch
(the bound, and the torch conversion store_kv_ref and the pool share, are in ketch/kv_dtype.py).
A pool of K/V's own dtype compiles without the clamp and stores the loaded bits unchanged.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ketch.kernels._common import last_dim_contiguous, pdl_launch, pow2
from ketch.kv_dtype import FP8_E4M3_MAX, to_kv_dtype

FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit(do_not_specialize_on_alignment=["Slots"])  # a view into the step's metadata buffer
def _store_kv_kernel(
    K, V, KCache, VCache, Slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    TO_FP8: tl.constexpr, USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr,
):
    t = tl.program_id(0)
    if USE_PDL:  # slots, k and v are this step's; the pool slots may still be read before us
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    slot = tl.load(Slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & (slot >= 0)
    safe_slot = tl.maximum(slot, 0)
    t64 = t.to(tl.int64)
    k = tl.load(K + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if TO_FP8:  # scale 1.0: saturate, then round to e4m3
        k = tl.minimum(tl.maximum(k.to(tl.float32), -FP8_MAX), FP8_MAX).to(KCache.dtype.element_ty)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -FP8_MAX), FP8_MAX).to(VCache.dtype.element_ty)
    dst = safe_slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(KCache + dst, k, mask=mask)
    tl.store(VCache + dst, v, mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k_cache/v_cache: one layer's pool, [pages, page_size, kv_heads, dim] (contiguous);
    k, v: [tokens, kv_heads, dim] (any token/head strides); slots: [tokens] int32/int64."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    kc = k_cache.view(-1, kv_heads, head_dim)
    vc = v_cache.view(-1, kv_heads, head_dim)
    _store_kv_kernel[(tokens,)](
        k, v, kc, vc, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=pow2(kv_heads), BLOCK_D=pow2(head_dim),
        TO_FP8=k_cache.dtype == torch.float8_e4m3fn and k.dtype != k_cache.dtype,
        num_warps=4 if kv_heads * head_dim >= 1024 else 1, **pdl_launch(tokens),
    )


def store_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    keep = slots >= 0
    kc = k_cache.view(-1, *k.shape[1:])
    vc = v_cache.view(-1, *v.shape[1:])
    kc[slots[keep].long()] = to_kv_dtype(k[keep], kc.dtype)
    vc[slots[keep].long()] = to_kv_dtype(v[keep], vc.dtype)


@triton.jit(do_not_specialize_on_alignment=["Slots"])
def _store_rows_kernel(X, Cache, Slots, stride_xt, stride_cs,
                       WIDTH: tl.constexpr, BLOCK: tl.constexpr, TO_FP8: tl.constexpr, USE_PDL: tl.constexpr,
                       EARLY_TRIGGER: tl.constexpr):
    t = tl.program_id(0)
    if USE_PDL:
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    slot = tl.load(Slots + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = (offs < WIDTH) & (slot >= 0)
    x = tl.load(X + t.to(tl.int64) * stride_xt + offs, mask=mask)
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if TO_FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -FP8_MAX), FP8_MAX).to(Cache.dtype.element_ty)
    tl.store(Cache + tl.maximum(slot, 0) * stride_cs + offs, x, mask=mask)


def store_rows(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    """One tensor per token (MLA's latent): cache [pages, page_size, width] (contiguous), x
    [tokens, width], slots [tokens] int32/int64, < 0 = padding (nothing written)."""
    tokens, width = x.shape
    if tokens == 0:
        return
    x = last_dim_contiguous(x)
    c = cache.view(-1, width)
    _store_rows_kernel[(tokens,)](
        x, c, slots, x.stride(0), c.stride(0),
        WIDTH=width, BLOCK=pow2(width), TO_FP8=cache.dtype == torch.float8_e4m3fn and x.dtype != cache.dtype,
        num_warps=4 if width >= 1024 else 2, **pdl_launch(tokens),
    )


def store_rows_ref(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    keep = slots >= 0
    cache.view(-1, x.shape[1])[slots[keep].long()] = to_kv_dtype(x[keep], cache.dtype)
