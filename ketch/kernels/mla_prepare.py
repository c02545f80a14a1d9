"""An MLA layer's glue between its projections and the attention, in one launch (DeepSeek-V2/V3,
ketch/models/deepseek.py):

    q       [tokens, heads, nope | rope]   the rope part rotated, in place
    latent  = rms_norm(ckv[:, :rank]) * w  |  rotated ckv[:, rank:]      a new [tokens, rank + rope]
    store = (cache, slots): the latent also written into the pool row of each token's slot
            (kv_store.store_rows' job, its fp8 conversion and padding slots < 0 included), so
            the attention backend stores nothing (MLATritonBackend.latent_sink): one launch less

where `rotated` first gathers DeepSeek's interleaved rope pairs to [even | odd] (when
`interleave`), then rotates in ketch's rotate-half layout (kernels/rotary.py: full-width cos and
signed sin rows). Torch took ~13 launches a layer for this (the two even/odd cats, two rotaries of
four ops, the q cat, the norm, the latent cat): ~15 µs of a DeepSeek-V2-Lite bs1 layer on the H200
(docs/performance.md, issue 19). The roundings are torch's: each rotary product rounded to the
activation dtype before the sum (kernels/rotary.py's `rotated`), the norm as kernels/rmsnorm.py; so the
result equals `mla_prepare_ref` up to fused multiply-add and summation-order differences.

    grid: (tokens,)   one program = one token: every q head's rope part, then the token's latent
"""
from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from ketch.kernels._common import pdl_launch, pow2
from ketch.kernels.head_gemv import head_block, plan_head_gemv
from ketch.kernels.kv_store import FP8_MAX
from ketch.kernels.rotary import rotated

# KETCH_MLA_ABSORB=0: the W_UK product back in the backend (mla_prepare, then head_gemv: two
# launches), the switch of the GPU A/B of mla_prepare_absorb alone
ABSORB_ENABLED = os.environ.get("KETCH_MLA_ABSORB", "1") != "0"


@triton.jit
def _gathered(offs, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Where element `offs` of the [even | odd] layout sits in the interleaved one."""
    if INTERLEAVE:
        return tl.where(offs < HALF, 2 * offs, 2 * (offs - HALF) + 1)
    return offs


@triton.jit
def prepare_token(
    t, Q, Ckv, Cos, Sin, Weight, Latent, Cache, Slots,
    stride_qt, stride_qh, stride_ct, stride_cos, stride_sin, stride_lt, stride_cs, eps,
    HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, RANK: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROPE: tl.constexpr, BLOCK_RANK: tl.constexpr,
    STORE: tl.constexpr, TO_FP8: tl.constexpr, USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr,
):
    """Token t's work (one program)."""
    t = t.to(tl.int64)
    HALF: tl.constexpr = ROPE // 2
    offs_r = tl.arange(0, BLOCK_ROPE)
    r_mask = offs_r < ROPE
    src = _gathered(offs_r, HALF, INTERLEAVE)
    src_partner = _gathered((offs_r + HALF) % ROPE, HALF, INTERLEAVE)
    offs_h = tl.arange(0, BLOCK_H)
    q_mask = (offs_h < HEADS)[:, None] & r_mask[None, :]
    offs_k = tl.arange(0, BLOCK_RANK)
    k_mask = offs_k < RANK
    w = tl.load(Weight + offs_k, mask=k_mask, other=0.0).to(tl.float32)  # a parameter: safe before the wait
    if USE_PDL:  # q and ckv come from the projections just before
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if STORE:
        slot = tl.load(Slots + t).to(tl.int64)
    q_rope = Q + t * stride_qt + offs_h[:, None] * stride_qh + NOPE
    x = tl.load(q_rope + src[None, :], mask=q_mask, other=0.0).to(tl.float32)
    xs = tl.load(q_rope + src_partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
    k_pe = Ckv + t * stride_ct + RANK
    k = tl.load(k_pe + src, mask=r_mask, other=0.0).to(tl.float32)
    ks = tl.load(k_pe + src_partner, mask=r_mask, other=0.0).to(tl.float32)
    c = tl.load(Ckv + t * stride_ct + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    cos = tl.load(Cos + t * stride_cos + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(Sin + t * stride_sin + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    dt = Q.dtype.element_ty
    # q's rope part in place: every element of it was loaded above (one program per token)
    tl.store(q_rope + offs_r[None, :], rotated(x, xs, cos[None, :], sin[None, :], dt), mask=q_mask)
    rstd = tl.rsqrt(tl.sum(c * c, 0) / RANK + eps)
    normed = (c * rstd).to(dt).to(tl.float32)
    c_out = (normed * w).to(dt)
    k_out = rotated(k, ks, cos, sin, dt)
    tl.store(Latent + t * stride_lt + offs_k, c_out, mask=k_mask)
    tl.store(Latent + t * stride_lt + RANK + offs_r, k_out, mask=r_mask)
    if STORE:  # store_rows' conversion and padding rule, into the pool row of the token's slot
        row = Cache + tl.maximum(slot, 0) * stride_cs
        if TO_FP8:
            c_out = tl.minimum(tl.maximum(c_out.to(tl.float32), -FP8_MAX), FP8_MAX)
            k_out = tl.minimum(tl.maximum(k_out.to(tl.float32), -FP8_MAX), FP8_MAX)
        tl.store(row + offs_k, c_out.to(Cache.dtype.element_ty), mask=k_mask & (slot >= 0))
        tl.store(row + RANK + offs_r, k_out.to(Cache.dtype.element_ty), mask=r_mask & (slot >= 0))



@triton.jit
def _mla_prepare_kernel(
    Q, Ckv, Cos, Sin, Weight, Latent, Cache, Slots,
    stride_qt, stride_qh, stride_ct, stride_cos, stride_sin, stride_lt, stride_cs, eps,
    HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, RANK: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROPE: tl.constexpr, BLOCK_RANK: tl.constexpr,
    STORE: tl.constexpr, TO_FP8: tl.constexpr, USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr,
):
    prepare_token(tl.program_id(0), Q, Ckv, Cos, Sin, Weight, Latent, Cache, Slots,
                  stride_qt, stride_qh, stride_ct, stride_cos, stride_sin, stride_lt, stride_cs, eps,
                  HEADS, NOPE, ROPE, RANK, INTERLEAVE, BLOCK_H, BLOCK_ROPE, BLOCK_RANK, STORE, TO_FP8, USE_PDL,
                  EARLY_TRIGGER)


@triton.jit
def _mla_prepare_absorb_kernel(
    Q, Ckv, Cos, Sin, Weight, Latent, Cache, Slots,
    stride_qt, stride_qh, stride_ct, stride_cos, stride_sin, stride_lt, stride_cs, eps,
    X, W, Out, Lse, SeqLens, rows,
    stride_xt, stride_xh, stride_wh, stride_wk, stride_wn, stride_ot, stride_oh, stride_xs, stride_lh,
    num_splits,
    HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, RANK: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROPE: tl.constexpr, BLOCK_RANK: tl.constexpr,
    STORE: tl.constexpr, TO_FP8: tl.constexpr,
    K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, MERGE: tl.constexpr, PRECISION: tl.constexpr,
    PRODUCT_PROGRAMS: tl.constexpr, PRODUCT_BLOCKS: tl.constexpr, USE_PDL: tl.constexpr, ALL_S: tl.constexpr = 0,
    SPLIT_BLOCK: tl.constexpr = 1,
):
    """The first PRODUCT_PROGRAMS programs: head_gemv's (q_nope W_UK, one head and output block
    each); the rest: one token's prepare each. Independent work (the product reads q's nope part,
    prepare writes its rope part and the latent), both after the projection before."""
    pid = tl.program_id(0)
    if pid < PRODUCT_PROGRAMS:
        head_block(pid // PRODUCT_BLOCKS, pid % PRODUCT_BLOCKS, X, W, Out, Lse, SeqLens, rows,
                   stride_xt, stride_xh, stride_wh, stride_wk, stride_wn, stride_ot, stride_oh, stride_xs, stride_lh,
                   num_splits, K, N, BLOCK_T, BLOCK_K, BLOCK_N, BLOCK_S, MERGE, PRECISION, USE_PDL)
    else:
        prepare_token(pid - PRODUCT_PROGRAMS, Q, Ckv, Cos, Sin, Weight, Latent, Cache, Slots,
                      stride_qt, stride_qh, stride_ct, stride_cos, stride_sin, stride_lt, stride_cs, eps,
                      HEADS, NOPE, ROPE, RANK, INTERLEAVE, BLOCK_H, BLOCK_ROPE, BLOCK_RANK, STORE, TO_FP8, USE_PDL,
                      False)

def _plan(q: torch.Tensor, ckv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
          eps: float, nope: int, interleave: bool,
          store: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple, dict[str, Any]]:
    """mla_prepare's checks: (latent, the kernel's arguments, its constexprs but the PDL ones)."""
    tokens, heads, head_dim = q.shape
    rope = head_dim - nope
    rank = ckv.shape[1] - rope
    if rope <= 0 or rope % 2 or weight.shape != (rank,):
        raise ValueError(f"mla_prepare: rope part {rope} must be even and positive, and weight {tuple(weight.shape)} "
                         f"of the latent's rank {rank}")
    if q.stride(2) != 1 or ckv.stride(1) != 1:
        raise ValueError("mla_prepare: q and ckv need a contiguous last dimension")
    cos, sin = cos.reshape(tokens, rope), sin.reshape(tokens, rope)
    latent = torch.empty((tokens, rank + rope), dtype=ckv.dtype, device=ckv.device)
    cache, slots = (latent, latent) if store is None else (store[0].view(-1, rank + rope), store[1])
    if store is not None and (slots.shape != (tokens,) or not cache.is_contiguous()):
        raise ValueError(f"mla_prepare: store needs a contiguous pool of rows {rank + rope} wide and a slot per token, "
                         f"got {tuple(store[0].shape)} and slots {tuple(slots.shape)}")
    args = (q, ckv, cos, sin, weight, latent, cache, slots,
            q.stride(0), q.stride(1), ckv.stride(0), cos.stride(0), sin.stride(0), latent.stride(0), cache.stride(0),
            eps)
    constexprs = dict(HEADS=heads, NOPE=nope, ROPE=rope, RANK=rank, INTERLEAVE=interleave, BLOCK_H=pow2(heads),
                      BLOCK_ROPE=pow2(rope), BLOCK_RANK=pow2(rank), STORE=store is not None,
                      TO_FP8=cache.dtype == torch.float8_e4m3fn and latent.dtype != cache.dtype)
    return latent, args, constexprs


def mla_prepare(q: torch.Tensor, ckv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                eps: float, nope: int, interleave: bool, *,
                store: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, nope + rope] (its rope part is overwritten), ckv [tokens, rank + rope],
    cos / sin [tokens, 1, rope] or [tokens, rope], weight [rank] -> (q, latent [tokens, rank + rope]).
    store = (cache [pages, page_size, rank + rope] contiguous, slots [tokens] int32 / int64, < 0:
    padding): the latent also goes into the pool (as store_rows(cache, latent, slots))."""
    latent, args, constexprs = _plan(q, ckv, cos, sin, weight, eps, nope, interleave, store)
    tokens = q.shape[0]
    if tokens:
        _mla_prepare_kernel[(tokens,)](*args, **constexprs, num_warps=4, **pdl_launch(tokens))
    return q, latent


def mla_prepare_absorb(q: torch.Tensor, ckv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       weight: torch.Tensor, eps: float, nope: int, interleave: bool, w_uk: torch.Tensor, *,
                       store: tuple[torch.Tensor, torch.Tensor] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mla_prepare, and the absorbed query q_lat = head_gemv(q[..., :nope], w_uk) [tokens, heads,
    rank] of decode rows (at most head_gemv.MAX_ROWS), in one launch: (q, latent, q_lat), the same
    bits as the two calls. At batch 1 the prepare's one program runs beside the product's instead
    of in a launch of its own on the critical path (docs/performance.md, issue 19)."""
    latent, args, constexprs = _plan(q, ckv, cos, sin, weight, eps, nope, interleave, store)
    product = plan_head_gemv(q[:, :, :nope], w_uk)
    tokens = q.shape[0]
    if tokens:
        programs = product.heads * product.blocks
        _mla_prepare_absorb_kernel[(programs + tokens,)](
            *args, *product.args, **constexprs, **product.constexprs, PRODUCT_PROGRAMS=programs,
            PRODUCT_BLOCKS=product.blocks, num_warps=product.num_warps, **pdl_launch())
    return q, latent, product.out


def mla_prepare_ref(q: torch.Tensor, ckv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                    eps: float, nope: int, interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch ops (new tensors; q untouched): the model's torch glue, op for op."""
    from ketch.kernels.rmsnorm import rms_norm_ref

    rope = q.shape[2] - nope
    rank = ckv.shape[1] - rope
    cos, sin = cos.reshape(-1, 1, rope), sin.reshape(-1, 1, rope)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        if interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), -1)
        return x * cos + x.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin

    latent = torch.cat((rms_norm_ref(ckv[:, :rank], weight, eps), rotate(ckv[:, None, rank:])[:, 0]), -1)
    return torch.cat((q[..., :nope], rotate(q[..., nope:])), -1), latent
