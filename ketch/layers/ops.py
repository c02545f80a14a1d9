"""The elementwise/norm operations of a decoder layer, picked once when the model is built.

    torch  : ketch's own torch layers (any device; bit for bit as before)
    native : the CPU default: RMSNorm (+ add) and RoPE as one C call each on bf16 rows
             (ketch/native/layer_ops.c, torch's roundings), SiLU·mul torch's; for fp32 torch's
             ops and the few-row fp32 product (ketch/native/f32_rows.c) for steps of <= 8 rows
    triton : the fused Triton kernels of ketch.kernels (CUDA): residual add + RMSNorm in one
             pass, RoPE rotated in place inside the fused qkv output, SiLU·mul in one pass,
             and the dense projections of decode steps of <= GEMV_MAX_M tokens as one
             skinny-GEMM kernel (F.linear above that), and a MoE layer's experts as the fused
             MoE grouped GEMM (ketch/kernels/fused_moe.py: no host sync, graph-safe) and its
             softmax top-k routing as one kernel (ketch/kernels/moe_route.py; Mixtral /
             Qwen-MoE, and DeepSeek-V2 routing that masks no group; DeepSeek's grouped top-k
             stays on torch), Qwen3's q / k head norms as one launch, an MLA layer's RoPE and
             latent norm as one launch, and at one decode row each pre-norm together with the
             sublayer's first product (ketch/kernels/norm_gemv.py)

Both sets have the same numerics contract (ketch/kernels/README.md: they round where torch's
bf16 ops round), so a model built with either gives the same tokens up to summation order.
The model holds a `LayerOps` and calls through it; nothing in the step loop branches on it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ketch.layers.activation import silu_and_mul as torch_silu_and_mul
from ketch.layers.rotary import apply_rotary

LAYER_KERNELS = ("torch", "triton", "native")


def torch_qk_norm(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                  num_q: int) -> torch.Tensor:
    """qk [tokens, q heads + k heads, dim] -> the q heads normed with q_weight, the k heads with
    k_weight (ketch.layers.norm.RMSNorm's formula per head), as a new tensor."""
    return torch.cat((_torch_rms_norm(qk[:, :num_q], q_weight, eps), _torch_rms_norm(qk[:, num_q:], k_weight, eps)), 1)


@dataclass(frozen=True)
class FirstProduct:
    """What a sublayer computes first from its normed input h: h @ weight^T (+ bias), in out_dtype
    (None: h's). The layer hands it to LayerOps.add_rms_norm_linear, which may compute it in the
    norm's launch (`first_product()` of the attention and MLP modules; None where not a plain
    dense product)."""
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class LayerOps:
    name: str
    # (x, weight, eps) -> rms_norm(x) * weight
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps) -> (rms_norm(x + residual) * weight, x + residual)
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    # (x [tokens, heads, dim], cos, sin [tokens, 1, dim]) -> rotated x; may overwrite x
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    # [tokens, 2 * inter] -> [tokens, inter]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # (x [tokens, in], weight [out, in], bias [out] or None) -> [tokens, out]; dense projections
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = F.linear
    # (x [tokens, in] of any float dtype, weight [out, in] fp32) -> fp32 [tokens, out]: fp32
    # router logits (DeepSeek); None: linear(x.float(), weight.float(), None)
    linear_fp32: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # (x, w13, w2, topk_weights, topk_ids) -> [tokens, hidden]: a MoE layer's experts (moe.py);
    # None: the torch reference (with its host-sync-free fallback while a graph is captured)
    fused_experts: Callable[..., torch.Tensor] | None = None
    # (logits [tokens, experts], top_k, renormalize[, scale=, append=, counts=]) -> (weights fp32,
    # ids int64) [tokens, top_k (+ append)]: softmax top-k routing (moe_routing.softmax_topk's
    # contract; the Triton kernel also scales, appends always-picked slots and counts picks:
    # kernels/moe_route.py); None: that torch function
    softmax_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # (qk [tokens, heads, dim], q_weight, k_weight, eps, num_q) -> new tensor: per-head q / k norms
    qk_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor] = torch_qk_norm
    # (qk, q_weight, k_weight, eps, num_q, cos, sin) -> new tensor: rotary(qk_norm(...)) in one
    # launch (Qwen3); None: those two ops
    qk_norm_rotary: Callable[..., torch.Tensor] | None = None
    # (q [tokens, heads, nope + rope], ckv [tokens, rank + rope], cos, sin, norm weight, eps, nope,
    # interleave[, store=(pool tensor, slots)]) -> (q with its rope part rotated, latent): an MLA
    # layer's glue (DeepSeek), the latent also written into the pool when store is given (the
    # backend's latent_sink); None: the model's torch ops
    mla_prepare: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # (x, residual or None, norm weight, eps, FirstProduct) -> (h, new residual, first product of
    # h): a sublayer's pre-norm and its first product, one launch at one decode row
    # (kernels/norm_gemv.py), the norm op then the product otherwise; None: the model calls the
    # norm and the sublayer computes its own product
    add_rms_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # (qk [tokens, heads, dim], cos, sin, num_q, v [tokens, kv_heads, dim], sink (k_cache, v_cache,
    # slots), norm (q_weight, k_weight, eps) or None) -> the q|k heads (normed and) rotated, the k
    # heads and v also written into the pool where the backend's kv_sink says, in one launch
    # (kernels/head_position.py); None: rotary / qk_norm_rotary, then the backend stores
    position_and_store: Callable[..., torch.Tensor] | None = None
    # mla_prepare's arguments and w_uk [heads, nope, rank] after interleave[, store=] -> (q, latent,
    # q_lat = q_nope W_UK [tokens, heads, rank]) in one launch, for a step of a few decode rows
    # (the backend's absorbs_query); None: mla_prepare, and the backend makes q_lat
    mla_prepare_absorb: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # (x, logits, w13, w2, top_k, renormalize[, scale=, append=, counts=, count_rows=, sum_picks=])
    # -> softmax_topk then fused_experts, the routing inside the experts' first launch at a step
    # of one token (kernels/moe_route_up.py); None: the two ops
    softmax_topk_experts: Callable[..., torch.Tensor] | None = None
    # whether a layer's output may be a one-token MoE step's weighted picks [1, k, H], unsummed
    # (fused_experts(sum_picks=False)): the norms after it (add_rms_norm, add_rms_norm_linear)
    # add the picks in fp32, round once, then add the residual, as the combine then the norm
    pick_rows: bool = False


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # the formula of ketch.layers.norm.RMSNorm (normalize, round, then scale)
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


def _torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = residual + x  # the same bits as the former `x = x + sublayer(...)`
    return _torch_rms_norm(s, weight, eps), s


TORCH_OPS = LayerOps("torch", _torch_rms_norm, _torch_add_rms_norm, apply_rotary, torch_silu_and_mul)


def triton_ops() -> LayerOps:
    """Imported on demand: the CPU path never loads Triton."""
    from ketch.kernels import norm_gemv
    from ketch.kernels.activation import silu_and_mul
    from ketch.kernels.fused_moe import fused_experts_triton
    from ketch.kernels.gemv import gemv
    from ketch.kernels.mla_prepare import ABSORB_ENABLED, mla_prepare, mla_prepare_absorb
    from ketch.kernels import moe_combine
    from ketch.kernels.moe_combine import moe_sum
    from ketch.kernels.moe_route import softmax_topk_triton
    from ketch.kernels.moe_route_up import routed_experts_triton
    from ketch.kernels import head_position
    from ketch.kernels.head_position import qk_rms_norm
    from ketch.kernels.rmsnorm import add_rms_norm, rms_norm
    from ketch.kernels.rotary import rotary

    def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotary(x, cos, sin, out=x)  # one program per token reads all its heads before writing

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # steps of <= GEMV_MAX_M tokens over a plain dense CUDA weight: the one-kernel skinny
        # GEMM; larger steps (prefill) and anything else: cuBLAS
        if (x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_M and x.is_cuda and weight.is_cuda
                and weight.dim() == 2 and weight.layout == torch.strided and weight.stride(-1) == 1
                and weight.dtype == x.dtype):
            return gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # decode-sized steps: x widened inside the skinny GEMM (no cast launch, the same bits)
        if (x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_M and x.is_cuda and weight.is_cuda
                and weight.dtype == torch.float32 and weight.dim() == 2 and weight.stride(-1) == 1):
            return gemv(x, weight, out_dtype=torch.float32)
        return F.linear(x.float(), weight.float())

    def qk_norm_rotary(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, num_q: int,
                       cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return qk_rms_norm(qk, q_weight, k_weight, eps, num_q, rope=(cos, sin))

    def summed(x: torch.Tensor) -> torch.Tensor:
        return moe_sum(x) if x.dim() == 3 else x  # a MoE step's unsummed picks (pick_rows)

    def add_picks_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(summed(x), residual, weight, eps)

    def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                            first: FirstProduct) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if norm_gemv.fits(x, first.weight):  # one decode row (or its MoE picks): one launch
            return norm_gemv.norm_gemv(x, residual, norm_weight, eps, first.weight, first.bias,
                                       out_dtype=first.out_dtype)
        x = summed(x)
        if residual is None:
            h, residual = rms_norm(x, norm_weight, eps), x
        else:
            h, residual = add_rms_norm(x, residual, norm_weight, eps)
        if first.out_dtype == torch.float32 and h.dtype != torch.float32:  # fp32 logits (a router)
            return h, residual, linear_fp32(h, first.weight.float())
        return h, residual, linear(h, first.weight, first.bias)

    def position_and_store(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int, v: torch.Tensor,
                           sink: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                           norm: tuple[torch.Tensor, torch.Tensor, float] | None) -> torch.Tensor:
        store = head_position.KVStore(*sink, v)
        if norm is None:
            return head_position.rotary_store(qk, cos, sin, num_q, store)
        return head_position.qk_rms_norm(qk, *norm, num_q, rope=(cos, sin), store=store)

    return LayerOps("triton", rms_norm, add_picks_rms_norm, rotate_in_place, silu_and_mul, linear=linear,
                    linear_fp32=linear_fp32, fused_experts=fused_experts_triton, softmax_topk=softmax_topk_triton,
                    qk_norm=qk_rms_norm, qk_norm_rotary=qk_norm_rotary, mla_prepare=mla_prepare,
                    add_rms_norm_linear=add_rms_norm_linear, position_and_store=position_and_store,
                    mla_prepare_absorb=mla_prepare_absorb if ABSORB_ENABLED else None,
                    softmax_topk_experts=routed_experts_triton, pick_rows=moe_combine.IN_NORM)


GEMV_MAX_M = 8  # ketch.kernels.gemv beat cuBLASLt at M = 1..8 on every Llama-8B projection (H200)


def native_ops(dtype: torch.dtype) -> LayerOps:
    """The CPU's: norms and RoPE as ketch's C calls (ketch/native/layer_ops.c) for a bf16
    model, each falling back to the torch op for tensors the C code does not take. An fp32 model
    (the parity configuration) keeps torch's norms and RoPE bit for bit, and takes ketch's
    few-row fp32 product (ketch/native/f32_rows.c) for the dense projections and the logits of
    steps of up to 8 rows: W read once at full speed whatever the row count (MKL's sgemm halves
    from 4 rows on: a 5-row speculative verify paid twice a decode step's weight time), each
    row's result independent of its batch. torch's ops where the libraries do not build."""
    from ketch.native import f32_rows
    from ketch.native import layer_ops as native

    if dtype == torch.float32 and f32_rows.available():
        return LayerOps("native", _torch_rms_norm, _torch_add_rms_norm, apply_rotary, torch_silu_and_mul,
                        f32_rows.make_linear(F.linear))
    if dtype != torch.bfloat16 or not native.available():
        return TORCH_OPS
    return LayerOps("native", native.make_rms_norm(_torch_rms_norm), native.make_add_rms_norm(_torch_add_rms_norm),
                    native.make_rotary(apply_rotary), torch_silu_and_mul)


def layer_ops(name: str, dtype: torch.dtype = torch.float32) -> LayerOps:
    if name == "torch":
        return TORCH_OPS
    if name == "triton":
        return triton_ops()
    if name == "native":
        return native_ops(dtype)
    raise ValueError(f"layer_kernels: unknown {name!r} (expected one of {', '.join(LAYER_KERNELS)})")
