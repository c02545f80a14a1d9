"""Residual add + RMSNorm + the product that reads the normed row, for one decode row, in one launch.

    norm_gemv(x [1, K], residual [1, K] or None, norm_weight [K], eps, weight [N, K], bias [N] or None,
              out_dtype=None) -> (h [1, K], new residual [1, K], y [1, N])

x may also be a one-token MoE step's weighted picks [1, k, K] (LayerOps.pick_rows): they are summed
in fp32 in pick order and rounded once first, moe_sum's bits, so the combine's launch goes too.

It is add_rms_norm (or rms_norm without a residual: the first layer, whose residual is x itself)
followed by gemv(h, weight, bias): rmsnorm.py's numerics (s = x + residual rounded, fp32
statistics, the normed row rounded before the weight's product, rounded again) and gemv.py's M=1
product (fp32 FMAs, one reduction per output). Why: at batch 1 a decoder layer's two norms are
two launches of one program each, latency-bound, on the critical path between weight streams
(docs/performance.md, issue 19). Every program of the product below reads the whole normed row
anyway, so each computes it itself (the row is 4-16 KB from L2) while its weight slice, requested
before the PDL wait, streams in; program 0 also writes h and the new residual for the layer's
later consumers (the residual add after the sublayer, a MoE's experts).

    grid: (min(cdiv(N, BLOCK_N), PROGRAMS_PER_SM x SMs),)  a program computes h once, then
    walks output blocks pid, pid + grid, ... of BLOCK_N features each, the whole K in one step
    (BLOCK_K = the next power of two of K, a 16 KB weight tile: K up to 8192).
    Its first two blocks' weight tiles are requested before the PDL wait, each later one two
    blocks ahead of the one in use (one where a single row is wider than the 16 KB tile, as a
    DeepSeek-V3 fp32 router row: three of those would cost an SM its second program).
    Capping the grid keeps the row's re-reads small: one program per output block read the
    8-16 KB row once per 16 KB of weight (gate|up of Llama-3.1-8B: 14,336 programs, 229 MB of
    row reads for 235 MB of weights), two per SM read it 264 times.

h and the residual are those of the rmsnorm kernel but for the order of the fp32 sum of squares
(the same bits in the interpreter: tests/test_norm_gemv_kernel.py); y is gemv's up to summation
order. Deterministic: no atomics, one program per output block.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ketch.kernels._common import interpreting, pdl_launch, pow2, sm_count
from ketch.kernels.gemv import whole_row_warps

MAX_K = 8192  # the whole row in one step per program
# The weight tile a program holds, in bytes (three in registers: the current block's and the
# next two): BLOCK_N = _TILE_BYTES // (BLOCK_K * weight element size), at least 1. sm_90 at 8
# warps (tests/test_norm_gemv_kernel.py): no spills at K 2048-8192, bf16 and an fp32 router weight.
_TILE_BYTES = 16384
# KETCH_NORM_GEMV=0: the norm and the product as two launches again (the H200 A/B's switch)
ENABLED = os.environ.get("KETCH_NORM_GEMV", "1") != "0"
# Weight tiles a program keeps requested beyond the one in use, 1 or 2 (1 regardless where one
# row is wider than _TILE_BYTES: their registers would cost an SM its second program). 2 is
# untimed on a GPU (docs/performance.md, thirty-ninth session); 1 is the earlier kernel, the
# A/B's base (scripts/h200_ab.sh VARIANTS="ketch.kernels.norm_gemv.TILES_AHEAD=1").
TILES_AHEAD = 2
PROGRAMS_PER_SM = 2  # the grid's cap (module docstring); a guess for the H200 sweep to settle
# The picks' rows loaded as one [pow2(picks), BLOCK_K] tile up to this many elements (8 picks of
# K 2048: Qwen3-30B-A3B, DeepSeek-V2-Lite with its shared experts); beyond, a row at a time.
MAX_PICK_TILE = 16384
INTERPRET_PROGRAMS = 3  # the interpreter: few programs, so the tests' small products take several blocks each


def two_ahead(block_n: int, block_k: int, element_size: int) -> bool:
    """Whether a program keeps two tiles requested ahead (TILES_AHEAD, and tiles of at most
    _TILE_BYTES: see TILES_AHEAD)."""
    return TILES_AHEAD == 2 and block_n * block_k * element_size <= _TILE_BYTES


@triton.jit
def _weight_tile(W, block, N, stride_wn, offs_bn, offs_k, k_mask, BLOCK_N: tl.constexpr):
    offs_n = block * BLOCK_N + offs_bn
    return tl.load(W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                   mask=(offs_n < N)[:, None] & k_mask[None, :], other=0.0)


@triton.jit(do_not_specialize=["n_blocks"])
def _norm_gemv_kernel(
    X, Residual, NormW, W, Bias, Y, H, ResOut, N, K, eps, stride_wn, stride_xp, n_blocks,
    PICKS: tl.constexpr, PICKS_PAD: tl.constexpr, PICKS_AT_ONCE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO_AHEAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs_bn = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    # parameters, requested before the wait: the first two output blocks' weight tiles (past N:
    # masked), the norm weight. Two, not one: after the wait the row's prologue (the picks' and
    # the residual's L2 reads, the sum of squares) outlasts one 16 KB tile a program, and the
    # loop below asks for its next tile only after that prologue.
    w = _weight_tile(W, pid, N, stride_wn, offs_bn, offs_k, k_mask, BLOCK_N)
    if TWO_AHEAD:
        w_ahead = _weight_tile(W, pid + step, N, stride_wn, offs_bn, offs_k, k_mask, BLOCK_N)
    else:
        w_ahead = w
    nw = tl.load(NormW + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if USE_PDL:  # x and the residual are earlier kernels' outputs
        tl.extra.cuda.gdc_wait()
    dt = H.dtype.element_ty
    if HAS_RESIDUAL:  # requested first, so that its round trip overlaps x's
        r = tl.load(Residual + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if PICKS == 1:
        s = tl.load(X + offs_k, mask=k_mask, other=0.0)
    elif PICKS_AT_ONCE:  # a MoE step's weighted picks, in one load
        # every pick's row requested at once: one L2 round trip after the wait, not one per pick
        # (the loop below leaves the compiler to issue a few loads ahead). The picks axis lies in
        # each thread's registers, so selecting row j is exact in-register arithmetic (+0s).
        offs_p = tl.arange(0, PICKS_PAD)
        rows = tl.load(X + offs_p[:, None] * stride_xp + offs_k[None, :],
                       mask=(offs_p < PICKS)[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for j in tl.static_range(PICKS):  # summed in fp32 in pick order, rounded once (moe_sum's)
            acc += tl.sum(tl.where(offs_p[:, None] == j, rows, 0.0), axis=0)
        s = acc.to(dt)
    else:  # the same sum a row at a time (DeepSeek-V3's 9 picks of 7168: no spills)
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for j in range(PICKS):
            acc += tl.load(X + j * stride_xp + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        s = acc.to(dt)
    if HAS_RESIDUAL:
        s = (s.to(tl.float32) + r).to(dt)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, 0) / K + eps)
    h = ((sf * rstd).to(dt).to(tl.float32) * nw).to(dt)
    writer = k_mask & (pid == 0)  # one program writes the row the layer keeps
    tl.store(H + offs_k, h, mask=writer)
    if HAS_RESIDUAL or PICKS > 1:
        tl.store(ResOut + offs_k, s, mask=writer)
    hf = h.to(tl.float32)[None, :]
    for block in range(pid, n_blocks, step):  # two tiles in flight beyond the one in use (or one)
        ahead = 2 * step if TWO_AHEAD else step
        w_next = _weight_tile(W, block + ahead, N, stride_wn, offs_bn, offs_k, k_mask, BLOCK_N)  # past N: masked
        offs_n = block * BLOCK_N + offs_bn
        n_mask = offs_n < N
        y = tl.sum(w.to(tl.float32) * hf, axis=1)
        if HAS_BIAS:
            y += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=n_mask)
        if TWO_AHEAD:
            w = w_ahead
            w_ahead = w_next
        else:
            w = w_next
    if USE_PDL:  # the weights are read
        tl.extra.cuda.gdc_launch_dependents()


def pick_constants(picks: int, block_k: int) -> dict[str, int | bool]:
    """The kernel's constexprs for a row (picks 1) or a MoE step's picks to sum first."""
    return {"PICKS": picks, "PICKS_PAD": pow2(picks), "PICKS_AT_ONCE": pow2(picks) * block_k <= MAX_PICK_TILE}


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether norm_gemv takes this step: one row on the GPU (or the interpreter), or a one-token
    MoE step's picks [1, k, K] to sum first (LayerOps.pick_rows), a plain row-major weight of x's
    dtype or fp32 (a router), K up to MAX_K."""
    on_device = x.is_cuda or interpreting()
    return (ENABLED and on_device and x.dim() in (2, 3) and x.shape[0] == 1 and weight.dim() == 2
            and weight.layout == torch.strided and weight.stride(-1) == 1 and weight.device == x.device
            and weight.dtype in (x.dtype, torch.float32) and 0 < x.shape[-1] <= MAX_K
            and weight.shape[1] == x.shape[-1])


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, new residual, y) as above; x [1, K] or a MoE step's picks [1, k, K] (summed as moe_sum
    does), last dim contiguous; the residual [1, K] or None (then the new residual is x itself, or
    the picks' sum). The caller checks `fits`."""
    if not fits(x, weight) or (residual is not None and tuple(residual.shape) != (1, x.shape[-1])):
        shape = None if residual is None else tuple(residual.shape)
        raise ValueError(f"norm_gemv: x {tuple(x.shape)}, residual {shape}, weight {tuple(weight.shape)} "
                         f"{weight.dtype} do not fit (one row, K <= {MAX_K})")
    n, k = weight.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    picks = x.shape[1] if x.dim() == 3 else 1
    h = torch.empty((1, k), dtype=x.dtype, device=x.device)
    res_out = x if residual is None and picks == 1 else torch.empty_like(h)
    y = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    block_k = pow2(k)
    block_n = max(1, _TILE_BYTES // (block_k * weight.element_size()))
    n_blocks = triton.cdiv(n, block_n)
    programs = min(n_blocks, INTERPRET_PROGRAMS if interpreting() else PROGRAMS_PER_SM * sm_count())
    _norm_gemv_kernel[(programs,)](
        x, x if residual is None else residual.contiguous(), norm_weight, weight, weight if bias is None else bias,
        y, h, res_out, n, k, eps, weight.stride(0), x.stride(1) if picks > 1 else 0, n_blocks,
        **pick_constants(picks, block_k),
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        TWO_AHEAD=two_ahead(block_n, block_k, weight.element_size()),
        num_warps=whole_row_warps(block_k), num_stages=1, **pdl_launch(),
    )
    return h, res_out, y
