"""The one-launch MoE step of one token (ketch/kernels/moe_stream.py: gate|up and down tiles of every
pick in one interleaved order, a counter per pick between them) against the layer's torch
reference and the two-launch direct path; its order; its counters back at zero after every launch;
fused_experts_triton's choice of it; its sm_90 build; a batch-1 engine on it keeping the torch
path's tokens.

Without CUDA the kernel runs in Triton's CPU interpreter (fp32, fp16; fp8 weights with fp32
activations) on one program, which walks the order itself; with CUDA compiled, with a grid of
every resident program, bf16 too, and in a CUDA graph.
"""
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from engine_cut import assert_same_tokens, batch_one_on_both_paths, cut_config  # noqa: E402
from fp8_blocks import dequantize_blocks, quantize_blocks  # noqa: E402
from ketch.kernels import fused_moe, moe_stream  # noqa: E402
from ketch.kernels.moe_stream import fused_experts_stream, unit_of  # noqa: E402
from ketch.layers.moe import fused_experts_ref  # noqa: E402
from ketch.layers.moe_routing import append_picks, softmax_topk  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
E, H, I = 10, 70, 42  # interpreter tiles: 16 features, K steps of 32: a partial block on every axis


def routed(top_k: int, seed: int, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(1, E - shared, generator=torch.Generator().manual_seed(seed))
    weights, ids = append_picks(*softmax_topk(logits, top_k, True), E - shared, shared)
    return weights.to(DEVICE), ids.to(DEVICE)


def experts(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = 0.2 * torch.randn(E, 2 * I, H, generator=g)
    w2 = 0.2 * torch.randn(E, H, I, generator=g)
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def token(dtype: torch.dtype, seed: int = 100) -> torch.Tensor:
    return torch.randn(1, H, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.fixture(autouse=True)
def stream_on(monkeypatch):
    monkeypatch.setattr(moe_stream, "ENABLED", True)


def counts_are_zero() -> bool:
    return all(int(buf.abs().sum()) == 0 for buf in moe_stream._counts.values())


def order(picks: int, n_up: int, n_down: int, lag: int) -> list[tuple[bool, int, int]]:
    """The module docstring's order, written out: U0 .. U(lag-1), D(j-lag) U(j) ..., the last D's."""
    units = [(True, j, b) for j in range(lag) for b in range(n_up)]
    for j in range(lag, picks):
        units += [(False, j - lag, b) for b in range(n_down)] + [(True, j, b) for b in range(n_up)]
    return units + [(False, j, b) for j in range(picks - lag, picks) for b in range(n_down)]


@triton.jit
def _order_kernel(Out, picks, n_up, n_down, lag, n_units):
    for i in range(0, n_units):
        is_up, pick, block = unit_of(i, picks, n_up, n_down, lag)
        tl.store(Out + 3 * i, is_up.to(tl.int32))
        tl.store(Out + 3 * i + 1, pick)
        tl.store(Out + 3 * i + 2, block)


@pytest.mark.parametrize("picks,n_up,n_down,lag", [(8, 3, 2, 2), (8, 1, 5, 1), (2, 4, 3, 2), (1, 2, 2, 1), (9, 2, 7, 3)])
def test_the_kernel_walks_the_order(picks, n_up, n_down, lag):
    """unit_of against the order written out: every tile once, and a pick's down tiles only after
    all of its gate|up tiles (what the counters' waits need to end)."""
    want = order(picks, n_up, n_down, lag)
    n_units = picks * (n_up + n_down)
    assert len(want) == n_units and len(set(want)) == n_units
    for at, (up, pick, _) in enumerate(want):
        if not up:
            assert max(i for i, u in enumerate(want) if u[0] and u[1] == pick) < at
    out = torch.full((n_units * 3,), -1, dtype=torch.int32, device=DEVICE)
    _order_kernel[(1,)](out, picks, n_up, n_down, lag, n_units)
    got = [(bool(u), p, b) for u, p, b in out.view(-1, 3).tolist()]
    assert got == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k,shared,lag", [(2, 0, 2), (4, 2, 2), (8, 2, 1), (3, 0, 9)])
def test_the_stream_is_the_reference(top_k, shared, lag, dtype, monkeypatch):
    """Picks with shared slots appended, every expert picked (k + shared = E), a lag of one, and
    one past the picks; the counters are zero after each launch."""
    monkeypatch.setattr(moe_stream, "LAG", lag)
    w13, w2 = experts(dtype)
    for seed in (1, 2):
        x = token(dtype, seed)
        weights, ids = routed(top_k, seed=seed, shared=shared)
        got = fused_experts_stream(x, w13, w2, weights, ids)
        ref = fused_experts_ref(x, w13, w2, weights, ids)
        assert got.dtype == dtype and got.shape == (1, H)
        torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
        assert counts_are_zero()


def test_the_picks_unsummed_are_the_direct_paths(monkeypatch):
    """sum_picks False (LayerOps.pick_rows): the weighted picks [1, P, H], each the direct path's
    row of that pick (a pick's rows swapped, or a weight on the wrong pick, would show)."""
    w13, w2 = experts(torch.float32, seed=3)
    x = token(torch.float32)
    weights, ids = routed(4, seed=7, shared=2)
    got = fused_experts_stream(x, w13, w2, weights, ids, sum_picks=False)
    monkeypatch.setattr(moe_stream, "ENABLED", False)
    want = fused_moe.fused_experts_triton(x, w13, w2, weights, ids, sum_picks=False)
    assert got.shape == want.shape == (1, 6, H)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_fp8_block_scaled_weights_are_the_dequantized_reference():
    """DeepSeek-V3-style fp8 weights, distinct 128 x 128 block scales; I = 192, H = 160: partial
    scale blocks on both products' K and rows."""
    hidden, inter = 160, 192
    g = torch.Generator().manual_seed(7)
    w13q, s13 = quantize_blocks(0.2 * torch.randn(E, 2 * inter, hidden, generator=g))
    w2q, s2 = quantize_blocks(0.2 * torch.randn(E, hidden, inter, generator=g))
    s13 = s13 * torch.linspace(0.5, 2.0, s13.numel()).view(s13.shape)
    s2 = s2 * torch.linspace(2.0, 0.5, s2.numel()).view(s2.shape)
    x = torch.randn(1, hidden, generator=g).to(DEVICE)
    weights, ids = routed(3, seed=4, shared=1)
    got = fused_experts_stream(x, w13q.to(DEVICE), w2q.to(DEVICE), weights, ids, w13_scale=s13.to(DEVICE),
                               w2_scale=s2.to(DEVICE))
    ref = fused_experts_ref(x.cpu(), dequantize_blocks(w13q, s13), dequantize_blocks(w2q, s2), weights.cpu(), ids.cpu())
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)
    assert counts_are_zero()


def test_fused_experts_triton_takes_it_at_one_token_only(monkeypatch):
    """On: one token streams, two tokens take the grouped path; off: nothing streams. Watched,
    not replaced; and a step it cannot take is refused by name."""
    calls: list[int] = []
    real = moe_stream.fused_experts_stream

    def watched(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(moe_stream, "fused_experts_stream", watched)
    w13, w2 = experts(torch.float32, seed=1)
    for tokens in (1, 2):
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
        weights, ids = (t.expand(tokens, -1).contiguous() for t in routed(2, seed=tokens))
        got = fused_moe.fused_experts_triton(x, w13, w2, weights, ids)
        torch.testing.assert_close(got, fused_experts_ref(x, w13, w2, weights, ids), atol=2e-5, rtol=2e-5)
    assert calls == [1]
    monkeypatch.setattr(moe_stream, "ENABLED", False)
    fused_moe.fused_experts_triton(token(torch.float32), w13, w2, *routed(2, seed=1))
    assert calls == [1]
    with pytest.raises(ValueError, match="one token"):
        real(torch.zeros(2, H, device=DEVICE), w13, w2, *(t.expand(2, -1) for t in routed(2, seed=1)))


def test_the_switch_from_the_environment():
    """KETCH_MOE_STREAM=1 turns it on; anything else (unset) leaves it off."""
    code = "import ketch.kernels.moe_stream as m; print(m.ENABLED)"
    for value, want in (("1", "True"), ("0", "False"), (None, "False")):
        env = {k: v for k, v in os.environ.items() if k != "KETCH_MOE_STREAM"}
        if value is not None:
            env["KETCH_MOE_STREAM"] = value
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        assert out.stdout.strip() == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replays_in_a_cuda_graph_on_new_routing():
    """Natively: a grid of every resident program, replayed 50 times on new routing, each replay
    the reference, the counters zero after each (a missed reset hangs or shows here)."""
    w13, w2 = experts(torch.bfloat16)
    x = token(torch.bfloat16)
    weights, ids = routed(6, seed=20, shared=2)
    fused_experts_stream(x, w13, w2, weights, ids)  # compile and make the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_stream(x, w13, w2, weights, ids)
    for seed in range(50):
        new_w, new_ids = routed(6, seed=21 + seed, shared=2)
        x.copy_(token(torch.bfloat16, seed=seed))
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out.float(), fused_experts_ref(x, w13, w2, weights, ids).float(),
                                   atol=2e-2, rtol=2e-2)
        assert counts_are_zero()


@pytest.mark.skipif(sys.platform != "linux", reason="the triton wheel's ptxas")
def test_the_kernel_compiles_for_sm90_two_to_an_sm():
    """The compiler sees what the interpreter does not: at the Hopper tiles, bf16 and fp8, no
    spills, nothing loaded or stored before the PDL wait, the weights through cp.async (the K
    steps pipelined: the sizes multiples of 16, as the models'), and registers and shared memory
    that let PROGRAMS_PER_SM programs share an SM (the grid's residency rests on it)."""
    script = """
from ketch.kernels import moe_stream as m
from ketch.kernels.compile_check import _compile, _usage
for fp8 in (False, True):
    w = "*fp8e4nv" if fp8 else "*bf16"
    sig = dict(X="*bf16", Inter="*bf16", Out="*bf16", W13=w, W2=w, Scale13="*fp32", Scale2="*fp32", Ids="*i64",
               TopkWeights="*fp32", Counts="*i32")
    fn = m._moe_stream_kernel
    sig = {n: sig.get(n, "i32") for n in fn.arg_names}
    consts = dict(FP8=fp8, UPCAST=False, PRECISION="tf32", UP_N=m.UP_BLOCK_N, DOWN_N=m.DOWN_BLOCK_N,
                  BLOCK_K=m.BLOCK_K, LINE=m.LINE_INTS, SPIN=True, USE_PDL=True)
    k = _compile(fn, sig, consts, 90, m.NUM_WARPS, m.NUM_STAGES, aligned=("I", "H"))  # as the models' sizes
    u = _usage("moe_stream", k)
    regs = -(-u.registers * 32 // 256) * 256 * m.NUM_WARPS
    fit = min(m.REGISTERS_PER_SM // regs, m.SHARED_MEMORY_PER_SM // (k.metadata.shared + 1024))
    print(fp8, u.registers, u.spill_bytes, k.metadata.shared, fit, u.loads_before_wait, u.stores_before_wait)
    assert u.spill_bytes == 0 and u.loads_before_wait == 0 and u.stores_before_wait == 0, u
    assert fit >= m.PROGRAMS_PER_SM, (u.registers, k.metadata.shared)
    assert "cp.async.cg.shared.global" in k.asm["ptx"]
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "qwen3-30b-a3b"])
def test_a_batch_one_engine_on_the_stream_keeps_the_torch_tokens(name, tmp_path):
    """End to end at batch 1 (every decode step one token), fp32 dummy weights of the config cut
    small: the stream gives the torch path's greedy tokens, logprobs within 1e-4; DeepSeek with its
    shared experts folded in as picks."""
    want, got, rows = batch_one_on_both_paths(cut_config(name, tmp_path), DEVICE.type, moe_stream,
                                              "fused_experts_stream", 6)
    assert rows and set(rows) == {1}, rows
    assert_same_tokens(want, got)
    assert counts_are_zero()
