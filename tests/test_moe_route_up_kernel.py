"""The one-token MoE with its routing inside the gate|up launch (ketch/kernels/moe_route_up.py)
against the two steps it replaces: the routing kernel then the fused experts (bit for bit in the
interpreter, within tolerance compiled), the counts they add, the fp8 weights, the unsummed
picks, and the switch back to two steps.

Without CUDA the kernels run in Triton's CPU interpreter (fp32 and fp16 there, bf16 compiled).
"""
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from fp8_blocks import quantize_blocks
from ketch.kernels import fused_moe, moe_decode, moe_route_up
from ketch.kernels.fused_moe import fused_experts_triton
from ketch.kernels.moe_route import softmax_topk_triton
from ketch.kernels.moe_route_up import routed_experts_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
H, I = 64, 32


def case(experts: int, slots: int, dtype: torch.dtype, seed: int, tokens: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(DEVICE, dtype)
    logits = (2 * torch.randn(tokens, experts, generator=g)).to(DEVICE)
    w13 = (0.2 * torch.randn(slots, 2 * I, H, generator=g)).to(DEVICE, dtype)
    w2 = (0.2 * torch.randn(slots, H, I, generator=g)).to(DEVICE, dtype)
    return x, logits, w13, w2


def two_steps(x, logits, w13, w2, *, counts=None, count_rows=None, sum_picks=True, **route):
    weights, ids = softmax_topk_triton(logits, counts=counts, count_rows=count_rows, **route)
    return fused_experts_triton(x, w13, w2, weights, ids, sum_picks=sum_picks)


def same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape
    if DEVICE.type == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.fixture(autouse=True)
def direct_path(monkeypatch):
    monkeypatch.setattr(moe_decode, "DECODE_MAX_TOKENS", 0)
    monkeypatch.setattr(fused_moe, "DIRECT_MAX_TOKENS", 1)
    monkeypatch.setattr(moe_route_up, "ENABLED", True)


def no_routing_launch(monkeypatch):
    """Fails the test if the routing kernel of the two-step path runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("the routing kernel ran")
    monkeypatch.setattr(moe_route_up, "softmax_topk_triton", refuse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k,append,renormalize,scale", [
    (8, 2, 0, True, 1.0),  # Mixtral
    (16, 4, 0, False, 1.0),  # Qwen3-MoE without norm_topk_prob
    (12, 3, 2, False, 2.5),  # DeepSeek-V2: scaled, two shared experts appended
    (5, 5, 0, True, 1.0),  # every expert picked; E not a power of two
])
def test_one_token_routes_in_the_up_launch_and_gives_the_two_steps_result(dtype, experts, top_k, append, renormalize,
                                                                         scale, monkeypatch):
    x, logits, w13, w2 = case(experts, experts + append, dtype, seed=experts + top_k)
    route = dict(top_k=top_k, renormalize=renormalize, scale=scale, append=append)
    want = two_steps(x, logits, w13, w2, **route)
    no_routing_launch(monkeypatch)
    got = routed_experts_triton(x, logits, w13, w2, **route)
    same(got, want, dtype)


def test_the_counts_are_the_routing_kernels_and_a_padding_row_counts_nothing(monkeypatch):
    experts, top_k = 16, 4
    x, logits, w13, w2 = case(experts, experts + 1, torch.float32, seed=3)
    route = dict(top_k=top_k, renormalize=True, append=1)
    want = torch.zeros(experts + 1, dtype=torch.int64, device=DEVICE)
    two_steps(x, logits, w13, w2, counts=want, **route)
    assert int(want.sum()) == top_k and int(want[experts]) == 0  # the appended slot is not counted
    got = torch.zeros_like(want)
    one = torch.ones(1, dtype=torch.int64, device=DEVICE)
    no_routing_launch(monkeypatch)
    routed_experts_triton(x, logits, w13, w2, counts=got, count_rows=one, **route)
    assert torch.equal(got, want)
    routed_experts_triton(x, logits, w13, w2, counts=got, count_rows=torch.zeros_like(one), **route)
    assert torch.equal(got, want), "a padding row (count_rows 0) counts nothing"


@pytest.mark.parametrize("dtype", DTYPES)
def test_unsummed_picks_are_the_two_steps_rows(dtype, monkeypatch):
    x, logits, w13, w2 = case(8, 8, dtype, seed=11)
    route = dict(top_k=3, renormalize=True)
    want = two_steps(x, logits, w13, w2, sum_picks=False, **route)
    assert want.shape == (1, 3, H)
    no_routing_launch(monkeypatch)
    got = routed_experts_triton(x, logits, w13, w2, sum_picks=False, **route)
    same(got, want, dtype)
    summed = routed_experts_triton(x, logits, w13, w2, **route)
    same(summed, fused_moe.moe_sum(want), dtype)


def test_fp8_block_scaled_weights():
    experts, top_k = 8, 2
    x, logits, w13, w2 = case(experts, experts, torch.float32, seed=5)
    q13, s13 = quantize_blocks(w13.cpu().float())
    q2, s2 = quantize_blocks(w2.cpu().float())
    s13 = s13 * torch.linspace(0.5, 2.0, s13.numel()).view(s13.shape)  # distinct scales: a wrong block shows
    q13, s13, q2, s2 = (t.to(DEVICE) for t in (q13, s13, q2, s2))
    weights, ids = softmax_topk_triton(logits, top_k, True)
    want = fused_experts_triton(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    got = routed_experts_triton(x, logits, q13, q2, top_k=top_k, renormalize=True, w13_scale=s13, w2_scale=s2)
    same(got, want, torch.float32)


def test_more_tokens_and_the_switch_take_the_two_steps(monkeypatch):
    """Two tokens, the switch off, or the direct path off: the routing kernel, then the experts."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return softmax_topk_triton(*args, **kwargs)

    monkeypatch.setattr(moe_route_up, "softmax_topk_triton", counting)
    route = dict(top_k=2, renormalize=True)
    x, logits, w13, w2 = case(8, 8, torch.float32, seed=9, tokens=2)
    same(routed_experts_triton(x, logits, w13, w2, **route), two_steps(x, logits, w13, w2, **route), torch.float32)
    assert calls == [2]
    x1, logits1 = x[:1], logits[:1]
    for module, name, off in ((moe_route_up, "ENABLED", False), (fused_moe, "DIRECT_MAX_TOKENS", 0)):
        monkeypatch.setattr(module, name, off)
        same(routed_experts_triton(x1, logits1, w13, w2, **route), two_steps(x1, logits1, w13, w2, **route),
             torch.float32)
        monkeypatch.undo()
        monkeypatch.setattr(moe_route_up, "softmax_topk_triton", counting)
        monkeypatch.setattr(moe_decode, "DECODE_MAX_TOKENS", 0)
        monkeypatch.setattr(fused_moe, "DIRECT_MAX_TOKENS", 1)
    assert calls == [2, 1, 1]


def test_bad_arguments_are_refused():
    x, logits, w13, w2 = case(8, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="top_k"):
        routed_experts_triton(x, logits, w13, w2, top_k=9, renormalize=True)
    with pytest.raises(ValueError, match="append"):
        routed_experts_triton(x, logits, w13, w2, top_k=2, renormalize=True, append=1)  # no slot for it
    with pytest.raises(ValueError, match="logits"):
        routed_experts_triton(x, logits[:, :4].repeat(2, 1), w13, w2, top_k=2, renormalize=True)
    with pytest.raises(ValueError, match="counts"):
        routed_experts_triton(x, logits, w13, w2, top_k=2, renormalize=True, counts=torch.zeros(8))


@pytest.mark.skipif(sys.platform != "linux", reason="the triton wheel's ptxas")
def test_the_kernel_compiles_for_sm90_without_spills():
    """At the Qwen3-30B-A3B and DeepSeek-V2-Lite (+ 2 shared) decode configs, as the JIT builds
    them for the models (N, K multiples of 16: K steps pipelined through cp.async): no spills,
    the stages fit in shared memory, nothing stored before the PDL wait (the logits are the
    router's output)."""
    script = """
import triton
from ketch.kernels.compile_check import _compile, _usage
from ketch.kernels.fused_moe import pick_config
from ketch.kernels.moe_route_up import _route_up_kernel as fn
for experts, slots, top_k, append, inter in ((128, 128, 8, 0, 768), (64, 66, 6, 2, 1408)):
    cfg = pick_config(1, slots, 2048, inter, top_k + append, "16")
    consts = dict(NUM_EXPERTS=experts, TOP_K=top_k, APPEND=append, K_PAD=triton.next_power_of_2(top_k + append),
                  RENORMALIZE=True, BLOCK_E=experts, COUNT=True, COUNT_ROWS=True, FP8=False, UPCAST=False,
                  PRECISION="tf32", BLOCK_M=cfg.block_m, BLOCK_N=cfg.up.block_n, BLOCK_K=cfg.up.block_k, USE_PDL=True)
    sig = dict(A="*bf16", W="*bf16", C="*bf16", Scale="*bf16", Logits="*fp32", Weights="*fp32", Ids="*i64",
               Counts="*i64", CountRows="*i64", scale="fp32")
    sig.update({n: "i32" for n in fn.arg_names if n not in sig})
    u = _usage("route_up", _compile(fn, sig, consts, 90, cfg.up.num_warps, cfg.up.num_stages, aligned=("N", "K")))
    print(experts, u.registers, u.spill_bytes, u.stores_before_wait, u.shared_bytes)
    assert u.spill_bytes == 0 and u.stores_before_wait == 0, u
    assert u.pipelined(), u  # the models' sizes (aligned): K steps through cp.async stages that fit
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v2-lite"])
def test_a_batch_one_engine_routes_in_the_up_launch_and_sums_in_the_next_norm(name, tmp_path, monkeypatch):
    """End to end at batch 1, fp32 dummy weights of the config cut small, eager steps: the Triton
    layer kernels keep the torch path's greedy tokens (logprobs within 1e-4) while every decode
    step's MoE routes inside its gate|up launch (the routing kernel runs for the prefill only) and
    leaves its picks to the next norm (norm_gemv sees [1, k, H])."""
    from conftest import greedy_ids_and_logprobs, make_tiny_engine
    from engine_cut import PROMPT, assert_same_tokens, cut_config
    from ketch.kernels import norm_gemv

    path = cut_config(name, tmp_path, num_hidden_layers=3)  # DeepSeek: a MoE layer before a norm_gemv
    reference = make_tiny_engine(path, device=DEVICE.type, attention_backend="torch", layer_kernels="torch",
                                 cuda_graph=False)
    want = greedy_ids_and_logprobs(reference, [PROMPT], 6)
    routing_rows, norm_dims = [], []
    real_route, real_norm = moe_route_up.softmax_topk_triton, norm_gemv.norm_gemv

    def route(logits, *args, **kwargs):
        routing_rows.append(logits.shape[0])
        return real_route(logits, *args, **kwargs)

    def norm(x, *args, **kwargs):
        norm_dims.append(x.dim())
        return real_norm(x, *args, **kwargs)

    monkeypatch.setattr(moe_route_up, "softmax_topk_triton", route)
    monkeypatch.setattr(norm_gemv, "norm_gemv", norm)
    engine = make_tiny_engine(path, device=DEVICE.type, attention_backend="triton", layer_kernels="triton",
                              cuda_graph=False)
    got = greedy_ids_and_logprobs(engine, [PROMPT], 6)
    engine.check_invariants()
    assert routing_rows and 1 not in routing_rows, routing_rows  # the prefill's only
    assert 3 in norm_dims, "a decode step's picks reached the norm after the MoE unsummed"
    assert_same_tokens(want, got)
