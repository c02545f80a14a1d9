"""A token's q and k heads put in position, in one launch: the per-head RMSNorm (Qwen3's q_norm /
k_norm), the rotary embedding, and, given the pool, the store of the new k and v into it.

    qk_rms_norm(qk, q_weight, k_weight, eps, num_q[, rope=(cos, sin)][, store=KVStore])
        the first num_q heads normed with q_weight, the rest with k_weight (rmsnorm.py's math
        per head); rope: each normed head also rotated (rotary.py's formula): the bits of
        rotary(qk_rms_norm(...)), where two norms, a cat and a rotary ran
    rotary_store(qk, cos, sin, num_q, store)
        the heads rotated in place (the bits of rotary(qk, cos, sin, out=qk)) and stored

    store = KVStore(k_cache, v_cache, slots, v): the k heads as written to the output, and v, go
        into the pool as kv_store.store_kv puts them (slot < 0: padding, nothing written; an fp8
        e4m3 pool: clamped, then cast). At batch 1 that store was a launch of its own a layer,
        latency-bound (docs/performance.md, issue 19); the attention backend then skips it
        (AttentionBackend.kv_sink, forward(stored=True)).

    grid: (tokens * heads,)  one program = one head of one token; a k head's program also copies
        the token's v head of the same index.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ketch.kernels._common import last_dim_contiguous, pdl_launch, pow2
from ketch.kernels.kv_store import FP8_MAX
from ketch.kernels.rotary import rotated


@dataclass(frozen=True)
class KVStore:
    """Where a layer's new k and v go: its pool tensors [pages, page_size, kv_heads, dim]
    (contiguous), the step's slots [tokens] (int32 / int64, < 0: padding), and v [tokens,
    kv_heads, dim] (any token / head strides, contiguous rows)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    v: torch.Tensor


@triton.jit
def _to_fp8(x, CACHE_DTYPE: tl.constexpr):
    """Scale 1.0: saturate, then round to e4m3 (kv_store.py's store)."""
    return tl.minimum(tl.maximum(x.to(tl.float32), -FP8_MAX), FP8_MAX).to(CACHE_DTYPE)


@triton.jit(do_not_specialize_on_alignment=["Slots"])  # a view into the step's metadata buffer
def _qk_rms_norm_kernel(
    X, WeightQ, WeightK, Out, Cos, Sin, V, KCache, VCache, Slots,
    stride_t, stride_h, stride_ot, stride_ct, stride_st, stride_vt, stride_vh, stride_cs, stride_ch, eps,
    HEADS: tl.constexpr, NUM_Q: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
    ROTATE: tl.constexpr, STORE: tl.constexpr, TO_FP8: tl.constexpr,
    USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr,
):
    """NORM: rmsnorm.py's math with the q or the k weight; ROTATE: then the rotary embedding of
    the (normed) head. Its partner half is normed from its own loads with the same rstd, the same
    elementwise ops on the same values, so the rotation sees exactly what a separate rotary
    kernel would load. STORE: a k head's result and the v head of its index into the pool."""
    pid = tl.program_id(0).to(tl.int64)
    t, h = pid // HEADS, pid % HEADS
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    partner = (offs + N // 2) % N
    if NORM:  # parameters: before the wait
        wq = tl.load(WeightQ + offs, mask=mask, other=0.0).to(tl.float32)
        wk = tl.load(WeightK + offs, mask=mask, other=0.0).to(tl.float32)
        if ROTATE:
            wq_p = tl.load(WeightQ + partner, mask=mask, other=0.0).to(tl.float32)
            wk_p = tl.load(WeightK + partner, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:  # x is the qkv projection's output (cos / sin, slots: this step's rows)
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + t * stride_t + h * stride_h + offs, mask=mask, other=0.0)
    if ROTATE:
        xs = tl.load(X + t * stride_t + h * stride_h + partner, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(Cos + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(Sin + t * stride_st + offs, mask=mask, other=0.0).to(tl.float32)
    if STORE:
        is_k = h >= NUM_Q
        slot = tl.load(Slots + t).to(tl.int64)
        keep = mask & is_k & (slot >= 0)
        kv_row = tl.maximum(slot, 0) * stride_cs + tl.maximum(h - NUM_Q, 0) * stride_ch + offs
        v = tl.load(V + t * stride_vt + tl.maximum(h - NUM_Q, 0) * stride_vh + offs, mask=keep, other=0.0)
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    dt = Out.dtype.element_ty
    if NORM:
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
        normed = (xf * rstd).to(dt).to(tl.float32)
        y = (normed * tl.where(h < NUM_Q, wq, wk)).to(dt)
        if ROTATE:
            xs = ((xs * rstd).to(dt).to(tl.float32) * tl.where(h < NUM_Q, wq_p, wk_p)).to(dt).to(tl.float32)
    else:
        y = x.to(dt)
    if ROTATE:
        y = rotated(y.to(tl.float32), xs, c, s, dt)
    tl.store(Out + t * stride_ot + h * N + offs, y, mask=mask)
    if STORE:
        if TO_FP8:
            tl.store(KCache + kv_row, _to_fp8(y, KCache.dtype.element_ty), mask=keep)
            tl.store(VCache + kv_row, _to_fp8(v, VCache.dtype.element_ty), mask=keep)
        else:
            tl.store(KCache + kv_row, y, mask=keep)
            tl.store(VCache + kv_row, v, mask=keep)


def _launch(qk: torch.Tensor, out: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor, float] | None, num_q: int,
            rope: tuple[torch.Tensor, torch.Tensor] | None, store: KVStore | None) -> torch.Tensor:
    tokens, heads, dim = qk.shape
    if rope is not None:
        if dim % 2:
            raise ValueError(f"head_dim: {dim} must be even for rotary embeddings")
        cos, sin = (last_dim_contiguous(r.reshape(tokens, dim)) for r in rope)
    else:
        cos = sin = out  # never read
    wq, wk, eps = weights if weights is not None else (out, out, 0.0)
    if store is not None:
        kv_heads = heads - num_q
        v = last_dim_contiguous(store.v)
        kc, vc = (c.view(-1, kv_heads, dim) for c in (store.k_cache, store.v_cache))
        if v.shape != (tokens, kv_heads, dim) or store.slots.shape != (tokens,) or not (
                store.k_cache.is_contiguous() and store.v_cache.is_contiguous()):
            raise ValueError(f"store: v {tuple(v.shape)} must be [tokens, k heads, dim] = {(tokens, kv_heads, dim)}, "
                             f"slots {tuple(store.slots.shape)} one per token, the pool contiguous")
        slots, to_fp8 = store.slots, kc.dtype == torch.float8_e4m3fn and qk.dtype != kc.dtype
    else:
        v = kc = vc = slots = out  # never read
        to_fp8 = False
    if tokens:
        _qk_rms_norm_kernel[(tokens * heads,)](
            qk, wq, wk, out, cos, sin, v, kc, vc, slots,
            qk.stride(0), qk.stride(1), out.stride(0), cos.stride(0), sin.stride(0),
            v.stride(0), v.stride(1), kc.stride(0), kc.stride(1), eps,
            HEADS=heads, NUM_Q=num_q, N=dim, BLOCK=pow2(dim), NORM=weights is not None, ROTATE=rope is not None,
            STORE=store is not None, TO_FP8=to_fp8, **pdl_launch(tokens * heads),
            num_warps=min(16, max(1, pow2(dim) // 256)))
    return out


def _heads_rows(qk: torch.Tensor) -> torch.Tensor:
    """The kernel reads each head as one contiguous row; a token stride is free."""
    return qk if qk.stride(-1) == 1 and qk.stride(1) == qk.shape[2] else qk.contiguous()


def qk_rms_norm(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, num_q: int,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, *, store: KVStore | None = None) -> torch.Tensor:
    """qk [tokens, heads, dim] (q heads, then k heads) -> a new contiguous [tokens, heads, dim]
    (see the module docstring); rope = (cos, sin), [tokens, dim] or [tokens, 1, dim]."""
    qk = _heads_rows(qk)
    out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
    return _launch(qk, out, (q_weight, k_weight, eps), num_q, rope, store)


def rotary_store(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int, store: KVStore) -> torch.Tensor:
    """qk [tokens, heads, dim] rotated in place (rows of contiguous heads, e.g. a view into the
    fused qkv; each program reads and writes its own head alone), its k heads and v stored."""
    if qk.stride(-1) != 1 or qk.stride(1) != qk.shape[2]:
        raise ValueError("rotary_store: qk's heads must be contiguous rows (it rotates in place)")
    return _launch(qk, qk, None, num_q, (cos, sin), store)
