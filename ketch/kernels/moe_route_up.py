"""A one-token MoE step with its softmax top-k routing inside the gate|up launch.

    routed_experts_triton(x [T, H], logits [T, E], w13, w2, *, top_k, renormalize, scale=1.0,
                          append=0, counts=None, count_rows=None, w13_scale=None, w2_scale=None,
                          sum_picks=True) -> [T, H] (or [1, k, H]: fused_moe's sum_picks)

is moe_route.softmax_topk_triton(logits, ...) then fused_moe.fused_experts_triton(x, w13, w2,
weights, ids, ...): the same routing (the same jit function, softmax_topk_row), the same GEMM
tiles (fused_moe.moe_tile), the same counts. Why: at batch 1 the routing kernel is one program
of a few hundred cycles between the router's product and the experts' weight streams, and its
launch, wait and tail on the critical path cost more than its arithmetic (docs/performance.md,
issue 19). Here every gate|up program routes the token itself from the E logits (a few hundred
bytes from L2) and takes its own pick's expert; the programs of output block 0 also write their
pick's weight and id (the down GEMM reads them after its wait) and add the routed pick to the
per-expert counts.

Steps of more than fused_moe.DIRECT_MAX_TOKENS tokens, those moe_decode takes, and all unless
KETCH_MOE_ROUTE_UP=1 (off by default: ENABLED) launch the routing kernel and then the experts.

    grid: ((top_k + append) * cdiv(I, BLOCK_N),), pick fastest (as fused_moe's direct blocks)
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ketch.kernels import fused_moe, moe_decode
from ketch.kernels._common import dot_precision, interpreting, pdl_launch, pow2
from ketch.kernels.moe_route import check_counts, softmax_topk_row, softmax_topk_triton

# Off by default: measured no faster (H100, bs1, same run, docs/performance.md): DeepSeek-V2-Lite
# 2.435 -> 2.430 ms a step, Qwen3-30B-A3B 3.143 -> 3.163 ms (its 128 experts' eight argmax rounds
# in every program cost what the routing launch did). KETCH_MOE_ROUTE_UP=1 turns it on.
ENABLED = os.environ.get("KETCH_MOE_ROUTE_UP", "0") != "0"


@triton.jit
def _route_up_kernel(
    A, W, C, Scale, Logits, Weights, Ids, Counts, CountRows, N, K, scale,
    stride_am, stride_we, stride_wn, stride_cm, stride_se, stride_sn, stride_sk,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, APPEND: tl.constexpr, K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, COUNT: tl.constexpr, COUNT_ROWS: tl.constexpr,
    FP8: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    pick = pid % (TOP_K + APPEND)
    pid_n = pid // (TOP_K + APPEND)
    if USE_PDL:  # the logits and x are the router's launch's outputs
        tl.extra.cuda.gdc_wait()
    offs_e = tl.arange(0, BLOCK_E)
    logits = tl.load(Logits + offs_e, mask=offs_e < NUM_EXPERTS, other=float("-inf")).to(tl.float32)
    weights, ids = softmax_topk_row(logits, scale, NUM_EXPERTS, TOP_K, APPEND, K_PAD, RENORMALIZE, BLOCK_E)
    mine = tl.arange(0, K_PAD) == pick
    expert = tl.sum(tl.where(mine, ids, 0), axis=0).to(tl.int64)
    writer = pid_n == 0  # one program per pick writes what the down GEMM reads
    tl.store(Weights + pick, tl.sum(tl.where(mine, weights, 0.0), axis=0), mask=writer)
    tl.store(Ids + pick, expert, mask=writer)
    if COUNT:  # a routed pick of a counted row (count_rows: a padded graph step's real rows)
        counted = writer & (pick < TOP_K)
        if COUNT_ROWS:
            counted = counted & (tl.load(CountRows) > 0)
        tl.atomic_add(Counts + expert, 1, mask=counted)
    rows = tl.full([BLOCK_M], pick, tl.int64)  # the pick's row of inter: a block of its own
    valid = tl.arange(0, BLOCK_M) == 0
    fused_moe.moe_tile(A, W, C, Scale, C, expert, rows, valid, pid_n, N, K,
                       stride_am, stride_we, stride_wn, stride_cm, stride_se, stride_sn, stride_sk,
                       TOP_K + APPEND, True, False, FP8, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, USE_PDL)


def routed_experts_triton(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                          top_k: int, renormalize: bool, scale: float = 1.0, append: int = 0,
                          counts: torch.Tensor | None = None, count_rows: torch.Tensor | None = None,
                          w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                          sum_picks: bool = True) -> torch.Tensor:
    """softmax_topk_triton then fused_experts_triton (their arguments, module docstring), the
    routing inside the gate|up launch at a step of one token."""
    tokens, experts = logits.shape
    if x.dim() != 2 or tokens != x.shape[0]:
        raise ValueError(f"routed_experts: logits {tuple(logits.shape)} for x {tuple(x.shape)}")
    # by shape (graph-safe); moe_decode's GEMV path, where switched on, keeps its steps
    if not (ENABLED and tokens == 1 and fused_moe.DIRECT_MAX_TOKENS >= 1 and moe_decode.DECODE_MAX_TOKENS < 1):
        weights, ids = softmax_topk_triton(logits, top_k, renormalize, scale=scale, append=append, counts=counts,
                                           count_rows=count_rows)
        return fused_moe.fused_experts_triton(x, w13, w2, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale,
                                              sum_picks=sum_picks)
    picks = top_k + append
    if not 0 < top_k <= experts or append < 0 or w13.shape[0] < experts + append:
        raise ValueError(f"routed_experts: top_k {top_k} + append {append} of {experts} experts "
                         f"({w13.shape[0]} weight slots)")
    check_counts(counts, experts, logits.device)
    fused_moe.check_shapes(x, w13, w2, w13_scale, w2_scale)
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    x = x if x.stride(-1) == 1 else x.contiguous()
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    w13, w2 = (w if w.stride(-1) == 1 else w.contiguous() for w in (w13, w2))
    cfg = fused_moe.pick_config(1, num_experts, hidden, inter, picks, "fp8" if w13_scale is not None else "16")
    weights = torch.empty(picks, dtype=torch.float32, device=x.device)
    ids = torch.empty(picks, dtype=torch.int64, device=x.device)
    inter_act = torch.empty(picks, inter, dtype=x.dtype, device=x.device)
    fp8 = w13_scale is not None
    _route_up_kernel[(picks * triton.cdiv(inter, cfg.up.block_n),)](
        x, w13, inter_act, w13_scale if fp8 else w13, logits, weights, ids, ids if counts is None else counts,
        ids if count_rows is None else count_rows, inter, hidden, float(scale),
        x.stride(0), w13.stride(0), w13.stride(1), inter_act.stride(0), *(w13_scale.stride() if fp8 else (0, 0, 0)),
        NUM_EXPERTS=experts, TOP_K=top_k, APPEND=append, K_PAD=pow2(picks), RENORMALIZE=renormalize,
        BLOCK_E=pow2(experts), COUNT=counts is not None, COUNT_ROWS=counts is not None and count_rows is not None,
        FP8=fp8, UPCAST=interpreting() or x.dtype == torch.float32, PRECISION=dot_precision(x.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.up.block_n, BLOCK_K=cfg.up.block_k,
        num_warps=cfg.up.num_warps, num_stages=cfg.up.num_stages, **pdl_launch(),
    )
    out = torch.empty(picks, hidden, dtype=x.dtype, device=x.device)
    fused_moe.moe_gemm(inter_act, w2, out, w2_scale, weights, ids, ids, ids, a_row_div=1, gated=False,
                       block_m=cfg.block_m, cfg=cfg.down, direct=True)
    picked = out.view(1, picks, hidden)
    return picked if not sum_picks else fused_moe.moe_sum(picked)
