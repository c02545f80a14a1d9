"""Softmax top-k routing of a sparse MoE layer (Mixtral, Qwen2/3-MoE) in one launch: router
logits [T, E] (fp32, bf16 or fp16) -> (topk_weights [T, k] fp32, topk_ids [T, k] int64), the
result of ketch.layers.moe_routing.softmax_topk (tests/test_moe_route_kernel.py compares them):

    probs = softmax(logits.float()) over all E experts; the k largest, in descending order;
    `renormalize`: divided by their sum; times `scale` (DeepSeek-V2's routed_scaling_factor);
    `append` slots after them: ids E, E+1, ... at weight 1 (DeepSeek's shared experts run as
    always-picked experts of the fused MoE: moe_routing.append_picks, the reference);
    `counts` given: each routed pick adds 1 to counts[id] (an int64 atomic: the per-expert load
    for /metrics and EPLB, where a scatter_add launch per layer broke the PDL chain); with
    `count_rows`, of the first count_rows[0] tokens only (a padded decode graph's real rows).

One program per token holds the token's E probabilities in registers (BLOCK_E = next power of
two of E; E <= 256 at one warp, more at four), then k rounds of argmax-and-mask on the
probabilities' int32 bits. Replaces torch's softmax + topk (radix sort, gatherTopK and a bitonic
sort kernel: ~15 µs a layer at bs1 on the H200, docs/performance.md) and the renormalising
division.

Ties: the choice is made on the fp32 probabilities, as torch's is; among equal probabilities
the lowest expert index is picked first. torch.topk promises no order among equal values, so
ids equal torch's whenever the k + 1 largest probabilities are distinct (the tests' case); on
an exact tie the weights are still the same values. Padding lanes (E..BLOCK_E) are never
picked; experts at probability 0 (logit -inf) only when fewer than k have any weight.

DeepSeek's grouped_topk (group masking, sigmoid scores, correction bias) stays on torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ketch.kernels._common import pdl_launch, pow2


@triton.jit
def softmax_topk_row(x, scale, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, APPEND: tl.constexpr,
                     K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    """One token's routing from its logits x [BLOCK_E] fp32 (-inf past NUM_EXPERTS) -> (weights
    fp32, ids int32), each [K_PAD]: slots 0..TOP_K-1 the picks, then the APPEND appended ones (the
    fused MoE's gate|up kernel runs this too, at one token: kernels/moe_route_up.py)."""
    offs = tl.arange(0, BLOCK_E)
    real = offs < NUM_EXPERTS
    # the max as an int32 reduction too: a float's bits, the magnitude bits flipped when negative,
    # order as the floats do (-inf the lowest; -0 below +0, either a right max)
    xb = x.to(tl.int32, bitcast=True)
    top = tl.max(xb ^ ((xb >> 31) & 0x7FFFFFFF), axis=0)
    p = tl.exp(x - (top ^ ((top >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True))
    p = p / tl.sum(p, axis=0)
    # Each round's two warp reductions on int32 (a max, then the lowest index holding it): a
    # probability is >= +0, so its fp32 bits order as integers do, and an int32 reduction is one
    # redux.sync instruction where a float max is a chain of shuffles (a round is dependent
    # latency: the routing launch's time). Padding's -1 is below every probability's bits.
    bits = tl.where(real, p.to(tl.int32, bitcast=True), -1)
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(bits, axis=0)
        pick = tl.min(tl.where(bits == best, offs, BLOCK_E), axis=0)  # the lowest index among ties
        weights = tl.where(slots == j, best.to(tl.float32, bitcast=True), weights)
        ids = tl.where(slots == j, pick, ids)
        bits = tl.where(offs == pick, -2, bits)  # below the padding: picked once
    if RENORMALIZE:
        weights = weights / tl.sum(tl.where(slots < TOP_K, weights, 0.0), axis=0)
    weights = weights * scale  # x 1.0 is exact: no scale, the same bits
    appended = (slots >= TOP_K) & (slots < TOP_K + APPEND)
    weights = tl.where(appended, 1.0, weights)
    ids = tl.where(appended, NUM_EXPERTS + slots - TOP_K, ids)
    return weights, ids


@triton.jit
def _softmax_topk_kernel(Logits, Weights, Ids, Counts, CountRows, stride_l, scale, NUM_EXPERTS: tl.constexpr,
                         TOP_K: tl.constexpr, APPEND: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_E: tl.constexpr, COUNT: tl.constexpr, COUNT_ROWS: tl.constexpr, USE_PDL: tl.constexpr,
                         EARLY_TRIGGER: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    if USE_PDL:  # the logits are the router GEMM's output
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(Logits + t * stride_l + offs, mask=offs < NUM_EXPERTS, other=float("-inf")).to(tl.float32)
    if COUNT_ROWS:  # loaded beside the logits (its latency hidden by theirs)
        counted = t < tl.load(CountRows)
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    weights, ids = softmax_topk_row(x, scale, NUM_EXPERTS, TOP_K, APPEND, K_PAD, RENORMALIZE, BLOCK_E)
    slots = tl.arange(0, K_PAD)
    width = TOP_K + APPEND
    tl.store(Weights + t * width + slots, weights, mask=slots < width)
    tl.store(Ids + t * width + slots, ids.to(tl.int64), mask=slots < width)
    if COUNT:  # integer adds: the totals do not depend on the order the programs reach them
        keep = slots < TOP_K
        if COUNT_ROWS:  # a padded step: only its first rows are traffic
            keep = keep & counted
        tl.atomic_add(Counts + ids, tl.full([K_PAD], 1, tl.int64), mask=keep)


def check_counts(counts: torch.Tensor | None, experts: int, device: torch.device) -> None:
    if counts is not None and (counts.dtype != torch.int64 or counts.dim() != 1 or counts.stride(0) != 1
                               or counts.numel() < experts or counts.device != device):
        raise ValueError(f"softmax_topk: counts must be a contiguous int64 vector of >= {experts} on "
                         f"{device}, got {counts.dtype} {tuple(counts.shape)} on {counts.device}")


def softmax_topk_triton(logits: torch.Tensor, top_k: int, renormalize: bool, *, scale: float = 1.0,
                        append: int = 0, counts: torch.Tensor | None = None,
                        count_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk's signature and result, times `scale`, with `append` always-picked slots
    (see above): [T, top_k + append]; the routed picks added into `counts` (int64, >= E entries,
    contiguous) when given, of the first count_rows[0] tokens only when that is given (an int64
    device scalar: a padded graph step's real rows). No host sync; grid (T,)."""
    tokens, experts = logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"softmax_topk: top_k {top_k} of {experts} experts")
    if append < 0:
        raise ValueError(f"softmax_topk: append {append} < 0")
    check_counts(counts, experts, logits.device)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty(tokens, top_k + append, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k + append, dtype=torch.int64, device=logits.device)
    if tokens:
        block_e = pow2(experts)
        _softmax_topk_kernel[(tokens,)](logits, weights, ids, ids if counts is None else counts,
                                        ids if count_rows is None else count_rows, logits.stride(0),
                                        float(scale), NUM_EXPERTS=experts, TOP_K=top_k, APPEND=append,
                                        K_PAD=pow2(top_k + append), RENORMALIZE=renormalize, BLOCK_E=block_e,
                                        COUNT=counts is not None, COUNT_ROWS=counts is not None and count_rows is not None,
                                        num_warps=1 if block_e <= 256 else 4,
                                        **pdl_launch(tokens))
    return weights, ids


softmax_topk_triton.counts_picks = True  # type: ignore[attr-defined]  # Router: pass ExpertLoad's row as counts=
