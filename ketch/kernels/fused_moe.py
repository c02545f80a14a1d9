"""Fused MoE experts: a grouped GEMM over expert-sorted, block-padded rows (moe_align.py).

    fused_experts_triton(x, w13, w2, topk_weights, topk_ids[, w13_scale=, w2_scale=]) -> [T, H]
        the signature and result of ketch.layers.moe.fused_experts_ref (tested against it:
        tests/test_fused_moe_kernel.py); x [T, H]; w13 [E, 2I, H] = [gate | up] rows per expert;
        w2 [E, H, I]; topk_weights / topk_ids [T, k]

Steps of up to moe_decode.DECODE_MAX_TOKENS tokens (0 by default: off) take moe_decode.py instead: a
GEMV per (token, pick) row, no alignment, the combine inside the down kernel. A step of one token
(DIRECT_MAX_TOKENS) skips the alignment: each pick's row is a block of its own, the flat top-k ids
the blocks' experts. Otherwise three launches after the alignment (no host sync anywhere: shapes
decide the grids):
    1. gate|up GEMM with SiLU·mul in its epilogue: one program holds BLOCK_M rows of one expert
       and BLOCK_N intermediate columns, accumulates gate and up (two fp32 accumulators over the
       same A tile: rows n and I + n of w13[e]) and writes silu(gate) * up -> inter [T*k, I],
       row = the (token, slot) id. Fused rather than a separate silu_and_mul kernel: one launch
       less (decode steps are launch-bound, kernels/README.md: a 3-4 µs floor each) and the
       [T*k, 2I] gate|up activations never reach memory.
    2. down GEMM over inter's rows, times the routing weight in the epilogue -> out [T*k, H].
    3. the combine (moe_combine.py): each token's k rows summed in fp32 and rounded once, as
       the reference's out.view(T, k, H).sum(1), in one short launch.
Rounding follows the reference (bf16 rounds where torch's bf16 ops round): gate and up are
rounded to the activation dtype, silu rounded before the product; the down result is rounded,
then multiplied by the weight rounded to the activation dtype.

Kernel: grid (blocks * n_tiles,), block index fastest, so the blocks of one expert run side by
side and share each W tile through L2. A program past num_tokens_post_padded returns after
the PDL wait (kernels/README.md rules: every program waits; nothing is loaded before the wait
because even the expert id comes from the alignment, written this step). Rows are gathered
through sorted_token_ids (row // k for x in the first GEMM, the row itself in the second);
sentinel rows are masked off on load and store.

fp8 (DeepSeek-V3 checkpoints): weights float8_e4m3fn with fp32 block scales [E, ceil(N/128),
ceil(K/128)]; each W tile is converted to the activation dtype, dotted, and the partial product
scaled by its rows' scales (BLOCK_K divides 128, so a K step lies inside one scale block).
Weight-only: activations stay bf16/fp16 (no per-token activation quantisation).

Block sizes: `pick_config` (a per-shape table, TUNED, for the H200 sweep to fill; untuned
shapes fall back to a heuristic by rows per expert). Per-step values (the number of rows) are
`do_not_specialize`, so a new batch size recompiles nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ketch.kernels import moe_decode
from ketch.kernels._common import dot_precision, interpreting, pdl_launch
from ketch.kernels.moe_align import moe_align
from ketch.kernels.moe_combine import moe_sum

FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size [128, 128]


def _direct_max_tokens() -> int:
    raw = os.environ.get("KETCH_MOE_DIRECT_TOKENS", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"KETCH_MOE_DIRECT_TOKENS must be 0 or 1, got {raw!r}")
    return int(raw)


# Steps of up to this many tokens skip the alignment: a lone token's k picks are k distinct
# experts, so the row of each pick is its own block (the flat top-k ids are the blocks' experts)
# and both GEMMs run the aligned path's tiles, in pick order rather than expert order. At two
# tokens and more, picks share experts and per-pick blocks would stream a shared expert twice.
# KETCH_MOE_DIRECT_TOKENS=0: the alignment at batch 1 too (the GPU A/B's switch).
DIRECT_MAX_TOKENS = _direct_max_tokens()


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoEConfig:
    block_m: int  # shared by both GEMMs: the alignment pads to it
    up: GemmConfig  # gate|up GEMM (block_n counts intermediate columns: 2 * block_n weight rows)
    down: GemmConfig


# Tuned configs: (E, H, I, top_k, weight kind "16" | "fp8") -> ((max tokens, config), ...) in
# ascending order of max tokens; the first bucket holding the step's token count wins. Empty
# until the H200 sweep (benchmarks/fused_moe.py) fills it: Qwen3-30B-A3B (128, 2048, 768, 8)
# and DeepSeek-V2-Lite (64, 2048, 1408, 6) first.
# (experts, hidden, intermediate, top_k, weight kind) -> ((up to tokens, config), ...), from
# `python benchmarks/fused_moe.py --sweep` on the H200 (2026-12-02, docs/performance.md, run 44)
TUNED: dict[tuple[int, int, int, int, str], tuple[tuple[int, MoEConfig], ...]] = {
    (128, 2048, 768, 8, "16"): (  # Qwen3-30B-A3B
        # the sweep's best at 1 token (block_m 64, the same GEMM tiles) spills 24 bytes at 255
        # registers: the 64-token tiles serve one token too
        (64, MoEConfig(16, GemmConfig(64, 128, 4, 3), GemmConfig(128, 128, 8, 3))),
        (512, MoEConfig(64, GemmConfig(64, 64, 4, 4), GemmConfig(128, 64, 4, 4))),
    ),
    (64, 2048, 1408, 6, "16"): (  # DeepSeek-V2-Lite
        (1, MoEConfig(16, GemmConfig(64, 128, 4, 3), GemmConfig(64, 128, 4, 4))),
        (64, MoEConfig(16, GemmConfig(32, 128, 4, 4), GemmConfig(64, 128, 4, 4))),
        (512, MoEConfig(64, GemmConfig(64, 64, 4, 4), GemmConfig(128, 64, 4, 4))),
    ),
}
# DeepSeek-V2-Lite with its 2 shared experts folded in (models/deepseek_moe.py: 64 + 2 experts,
# 6 + 2 picks): not swept yet; the routed shape's picks (the same GEMM tiles and K)
TUNED[(66, 2048, 1408, 8, "16")] = TUNED[(64, 2048, 1408, 6, "16")]

_INTERPRET = MoEConfig(16, GemmConfig(32, 32, 4, 1), GemmConfig(32, 32, 4, 1))


def pick_config(tokens: int, num_experts: int, hidden: int, inter: int, top_k: int, kind: str) -> MoEConfig:
    """Block sizes for one step (host side, from shapes only)."""
    if interpreting():
        return _INTERPRET
    for max_tokens, cfg in TUNED.get((num_experts, hidden, inter, top_k, kind), ()):
        if tokens <= max_tokens:
            return cfg
    rows_per_expert = tokens * top_k / num_experts
    # untuned guesses (Hopper): small row blocks while experts see few rows (decode), wide K
    # steps to keep weight bytes in flight; larger tiles once blocks fill up (prefill)
    if rows_per_expert <= 16:
        return MoEConfig(16, GemmConfig(32, 128, 4, 4), GemmConfig(64, 128, 4, 4))
    if rows_per_expert <= 64:
        return MoEConfig(32, GemmConfig(64, 64, 4, 4), GemmConfig(64, 64, 4, 4))
    return MoEConfig(64, GemmConfig(64, 64, 4, 3), GemmConfig(128, 64, 8, 3))


@triton.jit
def _k_step(acc, a, W, w_off, Scale, n_rows, n_mask, k0, offs_k, k_mask, stride_sn, stride_sk,
            FP8: tl.constexpr, PRECISION: tl.constexpr):
    """acc += a @ w^T for one [BLOCK_N, BLOCK_K] weight tile, converted to a's type; fp8: a fresh
    product scaled by its rows' block scales (the K step lies inside one scale block)."""
    w = tl.load(W + w_off + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(a.dtype)
    if FP8:
        s = tl.load(Scale + (n_rows // 128) * stride_sn + (k0 // 128) * stride_sk, mask=n_mask, other=0.0)
        acc += tl.dot(a, tl.trans(w), input_precision=PRECISION) * s[None, :]
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def moe_tile(A, W, C, Scale, TopkWeights, expert, rows, valid, pid_n, N, K,
             stride_am, stride_we, stride_wn, stride_cm, stride_se, stride_sn, stride_sk,
             A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr,
             UPCAST: tl.constexpr, PRECISION: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """One program's tile after the PDL wait: the rows `rows` (int64 [BLOCK_M], `valid` where
    real) of expert `expert` against its output block pid_n (also kernels/moe_route_up.py's)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + (rows // A_ROW_DIV)[:, None] * stride_am + offs_k[None, :]
    w_base = expert * stride_we
    w_off = w_base + offs_n.to(tl.int64)[:, None] * stride_wn
    u_off = w_base + (offs_n + N).to(tl.int64)[:, None] * stride_wn  # GATED: the up rows
    s_base = Scale + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:  # fp32 inputs, or the interpreter (whose bf16 is wrong)
            a = a.to(tl.float32)
        acc = _k_step(acc, a, W, w_off + k0, s_base, offs_n, n_mask, k0, offs_k, k_mask, stride_sn, stride_sk,
                      FP8, PRECISION)
        if GATED:
            acc_u = _k_step(acc_u, a, W, u_off + k0, s_base, offs_n + N, n_mask, k0, offs_k, k_mask, stride_sn,
                            stride_sk, FP8, PRECISION)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dt = C.dtype.element_ty
    if GATED:  # silu(gate) * up, rounded as the reference's F.linear then silu_and_mul
        g = acc.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        out = act * acc_u.to(dt).to(tl.float32)
    elif MUL_WEIGHT:
        wt = tl.load(TopkWeights + rows, mask=valid, other=0.0).to(dt).to(tl.float32)
        out = acc.to(dt).to(tl.float32) * wt[:, None]
    else:
        out = acc
    c_ptrs = C + rows[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(dt), mask=valid[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_rows", "num_m_blocks"],  # per step: T * k, padded blocks
            do_not_specialize_on_alignment=["SortedIds", "ExpertIds", "NumPostPad"])
def _moe_gemm_kernel(
    A, W, C, Scale, TopkWeights, SortedIds, ExpertIds, NumPostPad,
    N, K, num_rows, num_m_blocks,
    stride_am, stride_we, stride_wn, stride_cm, stride_se, stride_sn, stride_sk,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr, DIRECT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    pid_n = pid // num_m_blocks
    if USE_PDL:  # the ids, the expert of the block and A are all this step's
        tl.extra.cuda.gdc_wait()
    if DIRECT:  # block pid_m is the (token, slot) row pid_m alone: ExpertIds = the flat top-k ids
        expert = tl.load(ExpertIds + pid_m).to(tl.int64)
        valid = tl.arange(0, BLOCK_M) == 0
        rows = tl.full([BLOCK_M], pid_m, tl.int64)
    else:
        if pid_m * BLOCK_M >= tl.load(NumPostPad):
            return
        expert = tl.load(ExpertIds + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(SortedIds + offs_m)
        valid = rows < num_rows
        rows = rows.to(tl.int64)
    moe_tile(A, W, C, Scale, TopkWeights, expert, rows, valid, pid_n, N, K,
             stride_am, stride_we, stride_wn, stride_cm, stride_se, stride_sn, stride_sk,
             A_ROW_DIV, GATED, MUL_WEIGHT, FP8, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, USE_PDL)


def moe_gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, scale: torch.Tensor | None,
             topk_weights: torch.Tensor | None, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
             num_post_pad: torch.Tensor, *, a_row_div: int, gated: bool, block_m: int, cfg: GemmConfig,
             direct: bool = False) -> None:
    """c[row] = a[row // a_row_div] @ w[expert]^T for each row of each block (see the module
    docstring); gated: c = silu(gate) * up with w's rows [gate | up]; topk_weights: times the
    row's routing weight. c has one row per (token, slot); rows are never written twice.
    direct: no alignment; expert_ids is the flat [T * k] top-k ids and block r is row r alone
    (sorted_ids and num_post_pad unread)."""
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    fp8 = scale is not None
    num_m_blocks = expert_ids.shape[0]
    grid = (num_m_blocks * triton.cdiv(n, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, w, c, scale if fp8 else w, c if topk_weights is None else topk_weights,
        sorted_ids, expert_ids, num_post_pad,
        n, k, c.shape[0], num_m_blocks,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        *(scale.stride() if fp8 else (0, 0, 0)),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=topk_weights is not None, FP8=fp8, DIRECT=direct,
        UPCAST=interpreting() or a.dtype == torch.float32, PRECISION=dot_precision(a.dtype),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(),
    )


def check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                 w2_scale: torch.Tensor | None) -> None:
    e, two_i, h = w13.shape
    if x.dim() != 2 or x.shape[1] != h or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"fused_experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("fused_experts: fp8 needs both w13_scale and w2_scale")
    for w, s in ((w13, w13_scale), (w2, w2_scale)):
        if s is not None and tuple(s.shape) != (e, -(-w.shape[1] // FP8_BLOCK), -(-w.shape[2] // FP8_BLOCK)):
            raise ValueError(f"fused_experts: block scales {tuple(s.shape)} for weights {tuple(w.shape)}")


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
                         w2_scale: torch.Tensor | None = None, sum_picks: bool = True) -> torch.Tensor:
    """As fused_experts_ref: [T, H] in x's dtype. fp8: w13 / w2 float8_e4m3fn with their fp32
    block scales. No host sync (CUDA-graph safe); the grids depend on T, k, E and H, I only.
    sum_picks False: a step of one token (DIRECT_MAX_TOKENS) returns its weighted picks [1, k, H]
    unsummed, for the norm after the layer to add (LayerOps.pick_rows: one launch fewer); other
    steps are summed either way."""
    check_shapes(x, w13, w2, w13_scale, w2_scale)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_experts: topk_ids {tuple(topk_ids.shape)} for {x.shape[0]} tokens")
    tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    if tokens == 0:
        return x.new_empty(0, hidden)
    if tokens <= moe_decode.DECODE_MAX_TOKENS:  # by shape (graph-safe): a GEMV per row, no alignment
        return moe_decode.fused_experts_decode(x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
                                               w2_scale=w2_scale)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13, w2 = (w if w.stride(-1) == 1 else w.contiguous() for w in (w13, w2))
    cfg = pick_config(tokens, num_experts, hidden, inter, top_k, "fp8" if w13_scale is not None else "16")
    direct = tokens <= DIRECT_MAX_TOKENS  # by shape (graph-safe)
    if direct:  # one token: its picks are distinct experts already, one block each
        expert_ids = topk_ids.reshape(-1).contiguous()
        sorted_ids = num_post_pad = expert_ids  # unread
    else:
        sorted_ids, expert_ids, num_post_pad = moe_align(topk_ids, num_experts, cfg.block_m)
    rows = tokens * top_k
    inter_act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    moe_gemm(x, w13, inter_act, w13_scale, None, sorted_ids, expert_ids, num_post_pad,
             a_row_div=top_k, gated=True, block_m=cfg.block_m, cfg=cfg.up, direct=direct)
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    moe_gemm(inter_act, w2, out, w2_scale, weights, sorted_ids, expert_ids, num_post_pad,
             a_row_div=1, gated=False, block_m=cfg.block_m, cfg=cfg.down, direct=direct)
    if direct and not sum_picks:
        return out.view(tokens, top_k, hidden)
    return moe_sum(out.view(tokens, top_k, hidden))
