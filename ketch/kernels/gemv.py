"""Skinny GEMM / GEMV for small-batch decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= 8.

Decoding a few tokens is bound by how fast W streams from HBM. cuBLASLt at M=1 splits K over
programs and adds a separate reduce kernel on the smaller projections; this is one kernel with
no cross-program reduction:

    grid: (cdiv(N, BLOCK_N),)  one program = BLOCK_N output columns for all M rows.
        It walks K in BLOCK_K steps, loading a [BLOCK_N, BLOCK_K] tile of W (rows of W are
        contiguous along K: wide coalesced loads) and the [BLOCK_M, BLOCK_K] chunk of x (tiny,
        served from L1/L2), accumulates in fp32 and writes y once, in x's dtype.

Two paths, each its own autotuner over the same kernel (the M bucket, BLOCK_M, is a key):
    M = 1      BLOCK_M = 1: fp32 FMAs into a [BLOCK_N, BLOCK_K] partial, reduced once at the
               end; long K steps (1024) keep enough bytes in flight per SM.
    M = 2..8   BLOCK_M = 16: x padded (masked) to one tensor-core tile, tl.dot per K step
               (fp32 accumulator); loads pipelined through shared memory by num_stages.
               A per-step FMA + cross-thread reduction was 1.5-4x slower here (shuffle-bound).

Deterministic: no atomics, no split-K, so a fixed config always sums in the same order. Within
a path the configs differ only where the per-column summation order does not (see _configs),
so whichever config the autotuner picks, the bits are the same.

PDL (ketch/kernels/README.md): K step 0 is peeled so its W tile is loaded before gdc_wait; the
sums are the same operations in the same order, so PDL on and off give the same bits.

Whole rows at M = 1 (WHOLE_K, on by default; K <= WHOLE_K_MAX): BLOCK_K = K (next power of two) and BLOCK_N the
rows of a WHOLE_K_TILE-byte tile, so the peeled step is the program's whole weight slice: every
resident program has all its weight bytes requested before the PDL wait. With the latency-bound
kernels before it triggering early (attention at bs1), a product such as o_proj streams its
weights while they run instead of after them. Not autotuned (timed alone, the overlap it is for
does not show); one config per (N, K), so one summation order.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ketch.kernels._common import (
    dot_precision,
    interpreting,
    last_dim_contiguous,
    pdl_launch,
    pow2,
)

MAX_M = 8  # the kernel's own limit; callers pick their threshold (ketch/layers/ops.py)
# M = 1 products of K <= WHOLE_K_MAX as whole rows (module docstring); KETCH_GEMV_WHOLE_K=0: tiled.
# Same-run A/B (H100, bs1 decode, docs/performance.md): Qwen3-30B-A3B -0.7 %, DeepSeek-V2-Lite
# -0.6 %, Llama-3.1-8B -0.1 % a step.
WHOLE_K = os.environ.get("KETCH_GEMV_WHOLE_K", "1") != "0"
WHOLE_K_MAX = 8192
WHOLE_K_TILE = 16384  # bytes of weight a program holds (norm_gemv's tile)


def whole_rows(m: int, k: int, element_size: int) -> tuple[int, int] | None:
    """(BLOCK_N, BLOCK_K) of the whole-row path for an M x K product, None where it does not apply."""
    if m != 1 or not WHOLE_K or k > WHOLE_K_MAX:
        return None
    block_k = pow2(k)
    return (4 if interpreting() else max(1, WHOLE_K_TILE // (block_k * element_size))), block_k


def whole_row_warps(block_k: int) -> int:
    """Warps of a whole-row program (gemv's, norm_gemv's): 8 from rows of 2048 elements, so the
    tile's registers spread over more threads."""
    return 8 if block_k >= 2048 else 4


DOT_M = 16  # M = 2..8 is padded to one 16-row tensor-core tile


def _configs(dot: bool) -> list[triton.Config]:
    """Winners of a sweep on an H200 (bf16, Llama-3.1-8B shapes, CUDA graphs; the README).
    FMA path: BLOCK_K x num_warps fixed (each column's reduction tree depends only on them).
    Dot path: the fp32 accumulator is chained through the k-steps in order whatever BLOCK_N /
    BLOCK_K, so every config gives the same bits (tests/test_gemv.py checks both on the GPU)."""
    if interpreting():  # one config: autotuning would only time the interpreter
        return [triton.Config({"BLOCK_N": 16 if dot else 4, "BLOCK_K": 32 if dot else 64}, num_warps=4, num_stages=1)]
    if dot:
        return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=2, num_stages=s)
                for bn, bk, s in ((16, 512, 3), (32, 512, 3), (32, 256, 5), (32, 128, 3))]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": 1024}, num_warps=4, num_stages=1) for bn in (1, 2, 4, 8)]


@triton.jit
def _k_step(acc, w, x, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One K step: acc += x @ w^T for the loaded [BLOCK_N, BLOCK_K] w and [BLOCK_M, BLOCK_K] x."""
    if BLOCK_M == 1:
        # fp32 FMAs per (n, k) slot, reduced once after the loop (fp32 at once: the
        # interpreter's bf16 arithmetic is wrong)
        acc += w.to(tl.float32) * x.to(tl.float32)
    else:
        if UPCAST:  # fp32 inputs, or the interpreter (whose bf16 is wrong)
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gemv_kernel(
    X, W, Bias, Y, M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # per-(n, k) partial sums
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = 0
    if USE_PDL:
        # K step 0 peeled: its W tile is requested before waiting for the previous kernel
        # (weights are never written during a step), so W starts streaming from HBM during the
        # previous kernel's tail; x (the previous kernel's output) only after the wait.
        k_mask = offs_k < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _k_step(acc, w, x, BLOCK_M, UPCAST, PRECISION)
        k_lo = BLOCK_K
    for k0 in range(k_lo, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _k_step(acc, w, x, BLOCK_M, UPCAST, PRECISION)
    if USE_PDL:  # the main loop is done: let the next kernel launch and prefetch its weights
        tl.extra.cuda.gdc_launch_dependents()
    if BLOCK_M == 1:
        acc = tl.sum(acc, axis=1)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# one autotuner per path over the same kernel; each caches its pick per (N, K, BLOCK_M, dtypes)
_gemv_fma = triton.autotune(configs=_configs(dot=False), key=["N", "K", "BLOCK_M"])(_gemv_kernel)
_gemv_dot = triton.autotune(configs=_configs(dot=True), key=["N", "K", "BLOCK_M"])(_gemv_kernel)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [..., K] with at most MAX_M rows in all; weight: [N, K]; bias: [N] or None.
    Returns [..., N] in `out_dtype` (default x's; fp32 accumulation). x and weight may differ
    in dtype: a bf16 x against an fp32 weight (DeepSeek's router) is widened in registers, the
    same bits as gemv(x.float(), weight) without the cast's launch. No host sync: CUDA-graph
    safe once each (N, K, M bucket) has been autotuned outside the capture."""
    if weight.dim() != 2:
        raise ValueError(f"gemv: weight must be 2-D, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"gemv: x has {x.shape[-1]} features, weight expects {k}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"gemv: bias shape {tuple(bias.shape)} != ({n},)")
    x2 = last_dim_contiguous(x.reshape(-1, k))
    m = x2.shape[0]
    if m > MAX_M:
        raise ValueError(f"gemv: {m} rows > MAX_M={MAX_M}; use F.linear")
    weight = last_dim_contiguous(weight)
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    whole = whole_rows(m, k, weight.element_size())
    if whole is not None and n:
        block_n, block_k = whole
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x2, weight, weight if bias is None else bias, y, m, n, k,
            x2.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, UPCAST=interpreting() or torch.float32 in (x.dtype, weight.dtype),
            PRECISION=dot_precision(x.dtype), BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=whole_row_warps(block_k), num_stages=1, **pdl_launch(),
        )
    elif m and n:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        kernel, block_m = (_gemv_fma, 1) if m == 1 else (_gemv_dot, DOT_M)
        fp32 = torch.float32 in (x.dtype, weight.dtype)  # the dot path's operands: both widened
        kernel[grid](
            x2, weight, weight if bias is None else bias, y, m, n, k,
            x2.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, UPCAST=interpreting() or fp32,
            PRECISION=dot_precision(torch.float32 if fp32 else x.dtype), BLOCK_M=block_m, **pdl_launch(),
        )
    return y.view(*x.shape[:-1], n)


def picked_config(n: int, k: int, m: int) -> str | None:
    """The config for a shape, as text: the whole-row one (M = 1, WHOLE_K), else the autotuned one
    (None before the first call with it). Bf16/fp16 weights (the whole-row tile's rows depend on
    the element size)."""
    whole = whole_rows(m, k, 2)
    if whole is not None:
        return f"whole rows: BLOCK_N: {whole[0]}, BLOCK_K: {whole[1]}"
    tuner, block_m = (_gemv_fma, 1) if m == 1 else (_gemv_dot, DOT_M)
    if len(tuner.configs) == 1:
        return str(tuner.configs[0])
    for key, cfg in tuner.cache.items():
        if key[:3] == (n, k, block_m):
            return str(cfg)
    return None


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)
