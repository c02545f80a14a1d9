"""The fused MoE of decode-sized steps (ketch/kernels/moe_decode.py: a GEMV per (token, pick) row,
the down product and the combine in one launch) against the layer's torch reference
(ketch.layers.moe.fused_experts_ref); fused_experts_triton's choice of it by step size; its sm_90
build; a batch-1 engine on it keeping the torch path's tokens.

Without CUDA the kernels run in Triton's CPU interpreter (fp32, fp16; fp8 weights with fp32
activations); with CUDA compiled, bf16 too. Shapes with a partial block on every axis: H = 70
(interpreter K steps of 32, output blocks of 8), I = 42 (feature blocks of 4, K steps of 16).
"""
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from engine_cut import assert_same_tokens, batch_one_on_both_paths, cut_config  # noqa: E402
from fp8_blocks import dequantize_blocks, quantize_blocks  # noqa: E402
from ketch.kernels import fused_moe, moe_decode  # noqa: E402
from ketch.kernels.moe_decode import DecodeConfig, fused_experts_decode  # noqa: E402
from ketch.layers.moe import fused_experts_ref  # noqa: E402
from ketch.layers.moe_routing import append_picks, softmax_topk  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
E, H, I = 8, 70, 42


def routed(tokens: int, top_k: int, seed: int, shared: int = 0, experts: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k over the first experts - shared; the last `shared` slots appended at weight 1
    (DeepSeek's shared experts folded in: every token picks them, models/deepseek_moe.py)."""
    logits = torch.randn(tokens, experts - shared, generator=torch.Generator().manual_seed(seed))
    weights, ids = append_picks(*softmax_topk(logits, top_k, True), experts - shared, shared)
    return weights.to(DEVICE), ids.to(DEVICE)


def experts(dtype: torch.dtype, seed: int = 0, hidden: int = H, inter: int = I) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = 0.2 * torch.randn(E, 2 * inter, hidden, generator=g)
    w2 = 0.2 * torch.randn(E, hidden, inter, generator=g)
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def hidden_states(tokens: int, dtype: torch.dtype, hidden: int = H, seed: int = 100) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed + tokens)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,top_k,shared", [(1, 2, 0), (1, 4, 2), (3, 2, 2), (2, 8, 0)])
def test_decode_path_is_the_reference(tokens, top_k, shared, dtype):
    """One token and a few; shared slots every token picks (two tokens on one expert); every
    expert picked (k = E)."""
    w13, w2 = experts(dtype)
    x = hidden_states(tokens, dtype)
    weights, ids = routed(tokens, top_k, seed=tokens + top_k, shared=shared)
    got = fused_experts_decode(x, w13, w2, weights, ids)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (tokens, H)
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_each_pick_counts_once_with_its_own_weight():
    """The routing weight belongs to its pick: a token whose two picks are one expert at weights
    0.25 and 0.75 gets that expert's output once (what a swapped or shared weight would not)."""
    w13, w2 = experts(torch.float32, seed=5)
    x = hidden_states(2, torch.float32)
    ids = torch.tensor([[3, 3], [1, 6]], device=DEVICE)
    weights = torch.tensor([[0.25, 0.75], [0.9, 0.1]], device=DEVICE)
    got = fused_experts_decode(x, w13, w2, weights, ids)
    one = fused_experts_ref(x[:1], w13, w2, torch.ones(1, 1, device=DEVICE), ids[:1, :1])
    torch.testing.assert_close(got[:1], one, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, fused_experts_ref(x, w13, w2, weights, ids), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("tokens", [1, 2])
def test_fp8_block_scaled_weights_are_the_dequantized_reference(tokens):
    """DeepSeek-V3-style fp8 weights with distinct 128 x 128 block scales; I = 192 (gate and up
    each span two scale rows, the second partial) and H = 160 (a partial scale block on both
    products' K and on the down product's rows)."""
    hidden, inter = 160, 192
    g = torch.Generator().manual_seed(7)
    w13q, s13 = quantize_blocks(0.2 * torch.randn(E, 2 * inter, hidden, generator=g))
    w2q, s2 = quantize_blocks(0.2 * torch.randn(E, hidden, inter, generator=g))
    s13 = s13 * torch.linspace(0.5, 2.0, s13.numel()).view(s13.shape)  # a wrong block shows
    s2 = s2 * torch.linspace(2.0, 0.5, s2.numel()).view(s2.shape)
    x = hidden_states(tokens, torch.float32, hidden)
    weights, ids = routed(tokens, 3, seed=tokens, shared=1)
    got = fused_experts_decode(x, w13q.to(DEVICE), w2q.to(DEVICE), weights, ids, w13_scale=s13.to(DEVICE),
                               w2_scale=s2.to(DEVICE))
    ref = fused_experts_ref(x.cpu(), dequantize_blocks(w13q, s13), dequantize_blocks(w2q, s2), weights.cpu(), ids.cpu())
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="divide 128"):
        fused_experts_decode(x, w13q.to(DEVICE), w2q.to(DEVICE), weights, ids, w13_scale=s13.to(DEVICE),
                             w2_scale=s2.to(DEVICE), cfg=DecodeConfig(4, 96, 4, 8, 16, 4))


def test_no_tokens():
    w13, w2 = experts(torch.float32)
    weights, ids = routed(0, 2, seed=0)
    assert fused_experts_decode(torch.empty(0, H, device=DEVICE), w13, w2, weights, ids).shape == (0, H)


def test_fused_experts_triton_takes_it_up_to_decode_max_tokens(monkeypatch):
    """Steps of up to DECODE_MAX_TOKENS tokens skip the alignment (and its grouped GEMMs); larger
    ones, or any with the switch at 0, align; both give the reference. The alignment is watched,
    not replaced."""
    aligned: list[int] = []
    real_align = fused_moe.moe_align

    def watched(topk_ids, *args, **kwargs):
        aligned.append(topk_ids.shape[0])
        return real_align(topk_ids, *args, **kwargs)

    monkeypatch.setattr(fused_moe, "moe_align", watched)
    monkeypatch.setattr(fused_moe, "DIRECT_MAX_TOKENS", 0)  # the grouped path's lone token aligns too
    monkeypatch.setattr(moe_decode, "DECODE_MAX_TOKENS", 2)
    w13, w2 = experts(torch.float32, seed=1)
    for tokens in (1, 2, 3):
        x = hidden_states(tokens, torch.float32)
        weights, ids = routed(tokens, 2, seed=tokens, shared=1)
        got = fused_moe.fused_experts_triton(x, w13, w2, weights, ids)
        torch.testing.assert_close(got, fused_experts_ref(x, w13, w2, weights, ids), atol=2e-5, rtol=2e-5)
    assert aligned == [3]
    monkeypatch.setattr(moe_decode, "DECODE_MAX_TOKENS", 0)
    fused_moe.fused_experts_triton(hidden_states(1, torch.float32), w13, w2, *routed(1, 2, seed=1))
    assert aligned == [3, 1]


def test_the_switch_from_the_environment(monkeypatch):
    """KETCH_MOE_DECODE_TOKENS (the H200 A/B's switch): off (0) by default, a count, or refused
    naming the variable."""
    monkeypatch.delenv("KETCH_MOE_DECODE_TOKENS", raising=False)
    assert moe_decode._max_tokens_from_env() == 0
    monkeypatch.setenv("KETCH_MOE_DECODE_TOKENS", "1")
    assert moe_decode._max_tokens_from_env() == 1
    monkeypatch.setenv("KETCH_MOE_DECODE_TOKENS", "one")
    with pytest.raises(ValueError, match="KETCH_MOE_DECODE_TOKENS"):
        moe_decode._max_tokens_from_env()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replays_in_a_cuda_graph_on_new_routing():
    w13, w2 = experts(torch.bfloat16)
    x = hidden_states(1, torch.bfloat16)
    weights, ids = routed(1, 4, seed=20, shared=2)
    fused_experts_decode(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_decode(x, w13, w2, weights, ids)
    new_w, new_ids = routed(1, 4, seed=21, shared=2)
    x.copy_(hidden_states(1, torch.bfloat16, seed=7))
    weights.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(out.float(), fused_experts_ref(x, w13, w2, weights, ids).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(sys.platform != "linux", reason="the triton wheel's ptxas")
def test_kernels_compile_for_sm90_without_spills():
    """The compiler sees what the interpreter does not (register pressure, layouts): both kernels
    at the Hopper configs, bf16 and fp8, at DeepSeek-V2-Lite (+ 2 shared), Qwen3-30B-A3B and
    DeepSeek-V3 (+ 1 shared) top-k; nothing loaded or stored before the PDL wait (the ids are
    this step's routing)."""
    script = """
from ketch.kernels.compile_check import _compile, _usage
from ketch.kernels.moe_decode import _HOPPER, _HOPPER_FP8, _decode_down_kernel, _decode_gate_up_kernel
for top_k, fp8 in ((8, False), (8, False), (9, True)):
    cfg = _HOPPER_FP8 if fp8 else _HOPPER
    w = "*fp8e4nv" if fp8 else "*bf16"
    for fn, consts, warps in (
        (_decode_gate_up_kernel, dict(BLOCK_N=cfg.up_block_n, BLOCK_K=cfg.up_block_k), cfg.up_warps),
        (_decode_down_kernel, dict(BLOCK_H=cfg.down_block_h, BLOCK_I=cfg.down_block_i), cfg.down_warps),
    ):
        sig = dict(X="*bf16", Inter="*bf16", Out="*bf16", W=w, Scale="*fp32", Ids="*i64", TopkWeights="*fp32")
        sig = {n: sig.get(n, "i32") for n in fn.arg_names}
        u = _usage(fn.__name__, _compile(fn, sig, dict(TOP_K=top_k, FP8=fp8, USE_PDL=True, **consts), 90, warps, 1,
                                         aligned=("I", "H")))  # as the models' sizes (the JIT's 16-divisibility)
        print(fn.__name__, top_k, fp8, u.registers, u.spill_bytes, u.loads_before_wait, u.stores_before_wait)
        assert u.spill_bytes == 0 and u.loads_before_wait == 0 and u.stores_before_wait == 0, u
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "qwen3-30b-a3b"])
def test_a_batch_one_engine_on_the_triton_kernels_keeps_the_torch_tokens(name, tmp_path, monkeypatch):
    """End to end at batch 1 with the path switched on (one request: every decode step is one
    token), fp32 dummy weights of the config cut small: the Triton layer kernels (the interpreter
    without CUDA) give the torch path's greedy tokens, logprobs within 1e-4; DeepSeek with its
    shared experts folded into the fused MoE."""
    monkeypatch.setattr(moe_decode, "DECODE_MAX_TOKENS", 1)
    want, got, rows = batch_one_on_both_paths(cut_config(name, tmp_path), DEVICE.type, moe_decode,
                                              "fused_experts_decode", 6)
    assert rows and set(rows) == {1}, rows  # the decode steps took this path
    assert_same_tokens(want, got)
