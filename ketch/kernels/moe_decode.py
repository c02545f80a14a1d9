"""The fused MoE for decode-sized steps: no alignment, no separate combine, two launches.

    fused_experts_decode(x, w13, w2, topk_weights, topk_ids[, w13_scale=, w2_scale=]) -> [T, H]
        fused_experts_triton's signature and result (tested against layers.moe.fused_experts_ref:
        tests/test_moe_decode_kernel.py); fused_experts_triton sends steps of up to
        DECODE_MAX_TOKENS tokens here

At batch 1 the grouped GEMM path (fused_moe.py) is five launches a layer: routing, alignment,
gate|up GEMM, down GEMM, combine. Its alignment exists to group a step's (token, pick) rows by
expert so that a weight tile serves several rows; a decode step's few rows mostly pick distinct
experts, so there is nothing to group, and each launch at batch 1 costs a ramp and a tail in
which HBM idles (docs/performance.md, issue 19). Here each row is a GEMV against its expert:

    1. gate|up: grid (cdiv(I, BLOCK_N) * T*k,), one program = one (token, pick) row and BLOCK_N
       intermediate features, row fastest (a feature block of every pick side by side: two
       tokens that picked one expert, the shared experts always, read its tile together through
       L2). fp32 FMAs into [BLOCK_N, BLOCK_K] partials for gate and up, reduced once after the
       loop (gemv.py's M=1 form), silu(gate) * up -> inter [T*k, I].
    2. down + combine: grid (T, cdiv(H, BLOCK_H)), one program = BLOCK_H output features of one
       token. For each of the token's k picks in order it streams w2[expert]'s BLOCK_H rows (rows
       of w2 [E, H, I] are contiguous along I: whole-row reads) against the pick's inter row, then
       rounds, weights and adds the pick in fp32: the combine happens in registers, no [T*k, H]
       intermediate and no third launch.

Rounding follows the reference (and fused_moe.py): gate and up rounded to the activation dtype,
silu rounded before the product, inter stored in the activation dtype; each pick's down result
rounded, times the routing weight rounded to the activation dtype, rounded; the k picks summed
in fp32 in pick order and rounded once. Deterministic: no atomics, no split-K.

fp8 (DeepSeek-V3): float8_e4m3fn weights with fp32 [E, ceil(N/128), ceil(K/128)] block scales;
each weight is dequantized in fp32 (q * s, the reference's dequantized value) before its FMA.
BLOCK_K / BLOCK_I then divide 128, so a K step lies inside one scale block.

PDL (kernels/README.md): every program waits first (the expert ids are this step's routing);
the dependents launch after the main loop.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ketch.kernels._common import interpreting, pdl_launch

FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size


def _max_tokens_from_env() -> int:
    """KETCH_MOE_DECODE_TOKENS=<n> (0, the default: never) for H200 A/Bs (scripts/h200_ab.sh NEW_ENV)."""
    setting = os.environ.get("KETCH_MOE_DECODE_TOKENS", "0")
    if not setting.isdigit():
        raise ValueError(f"KETCH_MOE_DECODE_TOKENS: a token count, got {setting!r}")
    return int(setting)


# Steps of up to this many tokens take this path. Off (0): measured on the H200 (run 76,
# docs/performance.md) the batch-1 step was slower on it than on the grouped path, by 0.44 ms
# (Qwen3-30B-A3B, 48 layers) and 0.53 ms (DeepSeek-V2-Lite, 26): its GEMV-shaped programs stream
# the experts worse than the grouped GEMM's tiles, more than the two launches it saves. Kept
# (tested, opt-in) for a sweep of its blocks to revisit (benchmarks/fused_moe.py --decode).
DECODE_MAX_TOKENS = _max_tokens_from_env()


@dataclass(frozen=True)
class DecodeConfig:
    up_block_n: int  # intermediate features per gate|up program
    up_block_k: int  # hidden features per K step
    up_warps: int
    down_block_h: int  # output features per down program
    down_block_i: int  # intermediate features per K step
    down_warps: int


# Untuned guesses for Hopper, for the sweep to replace (gemv.py's M=1 shape: few rows, long K
# steps keep bytes in flight; ~2,800 gate|up and 256 down programs at DeepSeek-V2-Lite's bs1
# shape). Both fit without spills (sm_90: 95 and 128 registers; 8 gate|up rows at 4 warps
# spilled: two [8, 1024] fp32 partials).
_HOPPER = DecodeConfig(4, 1024, 8, 8, 512, 4)
_HOPPER_FP8 = DecodeConfig(8, 128, 4, 8, 128, 4)  # K steps inside one 128-wide scale block
# The interpreter: small blocks, so that the tests' small shapes still take several K steps and
# partial blocks on both axes.
_INTERPRET = DecodeConfig(4, 32, 4, 8, 16, 4)


def pick_decode_config(fp8: bool) -> DecodeConfig:
    if interpreting():
        return _INTERPRET
    return _HOPPER_FP8 if fp8 else _HOPPER


@triton.jit
def _dequant(w, Scale, n_rows, k0, n_mask, stride_sn, stride_sk, FP8: tl.constexpr):
    """A weight tile in fp32; fp8: times its rows' block scales (the step lies in one K block)."""
    w = w.to(tl.float32)
    if FP8:
        s = tl.load(Scale + (n_rows // 128) * stride_sn + (k0 // 128) * stride_sk, mask=n_mask, other=0.0)
        w = w * s[:, None]
    return w


@triton.jit(do_not_specialize=["rows"])
def _decode_gate_up_kernel(
    X, W, Inter, Scale, Ids, rows, I, H,
    stride_xt, stride_we, stride_wn, stride_ir, stride_se, stride_sn, stride_sk,
    TOP_K: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid % rows
    offs_n = (pid // rows) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    if USE_PDL:  # the ids are this step's routing, x this step's hidden state
        tl.extra.cuda.gdc_wait()
    expert = tl.load(Ids + row).to(tl.int64)
    x_ptrs = X + (row // TOP_K).to(tl.int64) * stride_xt + offs_k
    g_ptrs = W + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + I * stride_wn  # the up rows follow the gate rows
    s_base = Scale + expert * stride_se
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = (k0 + offs_k) < H
        w_mask = n_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptrs + k0, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        g = tl.load(g_ptrs + k0, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs + k0, mask=w_mask, other=0.0)
        acc_g += _dequant(g, s_base, offs_n, k0, n_mask, stride_sn, stride_sk, FP8) * x
        acc_u += _dequant(u, s_base, offs_n + I, k0, n_mask, stride_sn, stride_sk, FP8) * x
    if USE_PDL:  # the weights are read: the down kernel may launch
        tl.extra.cuda.gdc_launch_dependents()
    dt = Inter.dtype.element_ty
    gate = tl.sum(acc_g, axis=1).to(dt).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    out = act * tl.sum(acc_u, axis=1).to(dt).to(tl.float32)
    tl.store(Inter + row.to(tl.int64) * stride_ir + offs_n, out.to(dt), mask=n_mask)


@triton.jit
def _decode_down_kernel(
    Inter, W, Out, Scale, Ids, TopkWeights, I, H,
    stride_ir, stride_we, stride_wh, stride_ot, stride_se, stride_sn, stride_sk,
    TOP_K: tl.constexpr, FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_i = tl.arange(0, BLOCK_I)
    dt = Out.dtype.element_ty
    if USE_PDL:  # inter is the gate|up kernel's output
        tl.extra.cuda.gdc_wait()
    total = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):  # pick order: the reference's sum order
        row = (t * TOP_K + j).to(tl.int64)
        expert = tl.load(Ids + row).to(tl.int64)
        weight = tl.load(TopkWeights + row).to(dt).to(tl.float32)
        w_ptrs = W + expert * stride_we + offs_h.to(tl.int64)[:, None] * stride_wh + offs_i[None, :]
        a_ptrs = Inter + row * stride_ir + offs_i
        s_base = Scale + expert * stride_se
        acc = tl.zeros([BLOCK_H, BLOCK_I], tl.float32)
        for i0 in range(0, I, BLOCK_I):
            i_mask = (i0 + offs_i) < I
            a = tl.load(a_ptrs + i0, mask=i_mask, other=0.0).to(tl.float32)[None, :]
            w = tl.load(w_ptrs + i0, mask=h_mask[:, None] & i_mask[None, :], other=0.0)
            acc += _dequant(w, s_base, offs_h, i0, h_mask, stride_sn, stride_sk, FP8) * a
        down = tl.sum(acc, axis=1).to(dt).to(tl.float32)
        total += (down * weight).to(dt).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(Out + t.to(tl.int64) * stride_ot + offs_h, total.to(dt), mask=h_mask)


def fused_experts_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
                         w2_scale: torch.Tensor | None = None, cfg: DecodeConfig | None = None) -> torch.Tensor:
    """As fused_experts_triton (whose checks the caller has made): [T, H] in x's dtype. No host
    sync; the grids depend on T, k, I and H only (CUDA graphs)."""
    tokens, top_k = topk_ids.shape
    _, two_i, hidden = w13.shape
    inter = two_i // 2
    out = x.new_empty(tokens, hidden)
    if tokens == 0:
        return out
    fp8 = w13_scale is not None
    cfg = cfg or pick_decode_config(fp8)
    if fp8 and (FP8_BLOCK % cfg.up_block_k or FP8_BLOCK % cfg.down_block_i):
        raise ValueError(f"fused_experts_decode: fp8 K steps must divide {FP8_BLOCK}, got {cfg}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13, w2 = (w if w.stride(-1) == 1 else w.contiguous() for w in (w13, w2))
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    weights = topk_weights.float().contiguous()
    rows = tokens * top_k
    inter_act = x.new_empty(rows, inter)
    s13 = w13_scale.stride() if fp8 else (0, 0, 0)
    _decode_gate_up_kernel[(triton.cdiv(inter, cfg.up_block_n) * rows,)](
        x, w13, inter_act, w13_scale if fp8 else w13, ids, rows, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), inter_act.stride(0), *s13,
        TOP_K=top_k, FP8=fp8, BLOCK_N=cfg.up_block_n, BLOCK_K=cfg.up_block_k,
        num_warps=cfg.up_warps, num_stages=1, **pdl_launch(),
    )
    s2 = w2_scale.stride() if fp8 else (0, 0, 0)
    _decode_down_kernel[(tokens, triton.cdiv(hidden, cfg.down_block_h))](
        inter_act, w2, out, w2_scale if fp8 else w2, ids, weights, inter, hidden,
        inter_act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), *s2,
        TOP_K=top_k, FP8=fp8, BLOCK_H=cfg.down_block_h, BLOCK_I=cfg.down_block_i,
        num_warps=cfg.down_warps, num_stages=1, **pdl_launch(),
    )
    return out
