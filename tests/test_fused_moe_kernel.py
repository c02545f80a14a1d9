"""The fused MoE Triton kernels (ketch/kernels/moe_align.py, fused_moe.py) against the layer's
torch reference (ketch.layers.moe.fused_experts_ref), and the alignment's invariants.

Without CUDA the kernels run in Triton's CPU interpreter (set before triton is imported); it
gets fp32 and fp16 (its bf16 loads are wrong), fp8 weights with fp32 activations. With CUDA
the same tests run compiled, bf16 too. Small shapes: the interpreter is slow.
"""
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from fp8_blocks import dequantize_blocks, quantize_blocks
from ketch.kernels import fused_moe, moe_decode
from ketch.kernels.fused_moe import FP8_BLOCK, fused_experts_triton, pick_config
from ketch.kernels.moe_align import max_padded_rows, moe_align
from ketch.layers.moe import fused_experts_ref
from ketch.layers.moe_routing import softmax_topk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
E, K, H, I = 8, 2, 64, 32
EMPTY = 3  # an expert no token picks


def routed(tokens: int, seed: int, experts: int = E, top_k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    logits[:, EMPTY] = float("-inf")
    weights, ids = softmax_topk(logits, top_k, True)
    return weights.to(DEVICE), ids.to(DEVICE)


def experts(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = 0.2 * torch.randn(E, 2 * I, H, generator=g)
    w2 = 0.2 * torch.randn(E, H, I, generator=g)
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def check_alignment(ids: torch.Tensor, block_m: int) -> None:
    tokens, top_k = ids.shape
    rows = tokens * top_k
    sorted_ids, expert_ids, post = moe_align(ids, E, block_m)
    sorted_ids, expert_ids, post = sorted_ids.cpu().long(), expert_ids.cpu().long(), int(post.item())
    flat = ids.reshape(-1).cpu()
    assert sorted_ids.numel() == max_padded_rows(rows, E, block_m) and expert_ids.numel() * block_m == sorted_ids.numel()
    assert post % block_m == 0 and post <= sorted_ids.numel()
    used = sorted_ids[:post]
    real = used[used < rows]
    assert torch.equal(real.sort().values, torch.arange(rows)), "every (token, slot) row exactly once"
    assert bool((used[used >= rows] == rows).all()) and bool((sorted_ids[post:] == rows).all()), "padding: sentinels"
    counts = torch.bincount(flat, minlength=E)
    assert post == int(((counts + block_m - 1) // block_m * block_m).sum()), "each run padded to the next block only"
    for b in range(post // block_m):
        block = sorted_ids[b * block_m : (b + 1) * block_m]
        block = block[block < rows]
        assert block.numel() > 0, "no all-padding block"
        assert bool((flat[block] == expert_ids[b]).all()), "one expert per block"
        assert bool((block[1:] > block[:-1]).all()), "rows in order inside an expert"
    assert bool((expert_ids[post // block_m :] == -1).all())
    assert EMPTY not in expert_ids.tolist()


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("block_m", [16, 64])
def test_align_invariants(tokens, block_m):
    check_alignment(routed(tokens, seed=tokens)[1], block_m)


def test_align_one_expert_takes_every_row():
    check_alignment(torch.full((20, K), 5, device=DEVICE).index_fill_(1, torch.tensor([1], device=DEVICE), 6), 16)


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_experts_triton_is_the_reference(tokens, dtype, monkeypatch):
    """T < BLOCK_M (1, 5) and several blocks per expert (64 tokens * 2 picks over 7 experts at
    BLOCK_M 16); expert EMPTY gets no rows. The grouped GEMMs at one token too (that step
    otherwise takes moe_decode.py's path: tests/test_moe_decode_kernel.py)."""
    monkeypatch.setattr(moe_decode, "DECODE_MAX_TOKENS", 0)
    w13, w2 = experts(dtype)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(100 + tokens)).to(DEVICE, dtype)
    weights, ids = routed(tokens, seed=tokens)
    assert bool((ids != EMPTY).all())
    got = fused_experts_triton(x, w13, w2, weights, ids)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (tokens, H)
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, K, 5])
def test_one_token_skips_the_alignment_and_keeps_the_aligned_result(dtype, top_k, monkeypatch):
    """A lone token's picks are the blocks themselves (DIRECT_MAX_TOKENS): no alignment launch,
    the aligned path's tiles in pick order, so the result is the aligned path's (bit for bit in
    the interpreter; compiled variants may order FMAs apart) and the reference's. Two tokens
    still align."""
    monkeypatch.setattr(moe_decode, "DECODE_MAX_TOKENS", 0)
    aligned = []

    def counting_align(*args, **kwargs):
        aligned.append(args[0].shape[0])
        return moe_align(*args, **kwargs)

    monkeypatch.setattr(fused_moe, "moe_align", counting_align)
    w13, w2 = experts(dtype, seed=top_k)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(7 + top_k)).to(DEVICE, dtype)
    weights, ids = routed(1, seed=40 + top_k, top_k=top_k)
    monkeypatch.setattr(fused_moe, "DIRECT_MAX_TOKENS", 1)
    direct = fused_experts_triton(x, w13, w2, weights, ids)
    assert aligned == [], "one token: no alignment"
    monkeypatch.setattr(fused_moe, "DIRECT_MAX_TOKENS", 0)
    through_alignment = fused_experts_triton(x, w13, w2, weights, ids)
    assert aligned == [1]
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(direct.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if DEVICE.type == "cpu":
        assert torch.equal(direct, through_alignment)
    else:
        torch.testing.assert_close(direct.float(), through_alignment.float(), atol=TOL[dtype], rtol=TOL[dtype])
    monkeypatch.setattr(fused_moe, "DIRECT_MAX_TOKENS", 1)
    two = torch.cat([x, -x])
    weights2, ids2 = routed(2, seed=50 + top_k, top_k=top_k)
    got2 = fused_experts_triton(two, w13, w2, weights2, ids2)
    assert aligned == [1, 2], "two tokens: aligned"
    torch.testing.assert_close(got2.float(), fused_experts_ref(two, w13, w2, weights2, ids2).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_direct_tokens_switch_is_checked(monkeypatch):
    monkeypatch.setenv("KETCH_MOE_DIRECT_TOKENS", "2")
    with pytest.raises(ValueError, match="KETCH_MOE_DIRECT_TOKENS"):
        fused_moe._direct_max_tokens()
    monkeypatch.setenv("KETCH_MOE_DIRECT_TOKENS", "0")
    assert fused_moe._direct_max_tokens() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 8, 2048), (5, 2, 64), (3, 6, 1500)])
def test_combine_is_the_references_sum(tokens, top_k, hidden, dtype):
    """The fused path's third launch: each token's k rows summed (fp32, one rounding) as
    `out.view(T, k, H).sum(1)` does; a hidden size past one block and not a power of two too."""
    from ketch.kernels.moe_combine import moe_sum

    rows = torch.randn(tokens, top_k, hidden, generator=torch.Generator().manual_seed(hidden + top_k)).to(dtype)
    got = moe_sum(rows.to(DEVICE))
    ref = rows.float().sum(dim=1).to(dtype)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    torch.testing.assert_close(got.cpu().float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert moe_sum(torch.empty(0, top_k, hidden, dtype=dtype, device=DEVICE)).shape == (0, hidden)
    with pytest.raises(ValueError, match="tokens, top_k, hidden"):
        moe_sum(rows[0].to(DEVICE))


def test_no_tokens_and_bad_shapes():
    w13, w2 = experts(torch.float32)
    weights, ids = routed(0, seed=0)
    assert fused_experts_triton(torch.empty(0, H, device=DEVICE), w13, w2, weights, ids).shape == (0, H)
    x = torch.randn(2, H, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        fused_experts_triton(x, w13, w2[:, :, :-1], *routed(2, seed=1))
    with pytest.raises(ValueError, match="fp8 needs both"):
        fused_experts_triton(x, w13, w2, *routed(2, seed=1), w13_scale=torch.ones(E, 1, 1))


@pytest.mark.parametrize("tokens", [12])
def test_fp8_block_scaled_weights_are_the_dequantized_reference(tokens):
    """DeepSeek-V3-style fp8 weights, 128x128 block scales; I = 192 rows of w13 (two gate and two
    up scale rows, one of each partial) and H = 160 columns of w2's K (a partial block)."""
    hidden, inter = 160, 96
    g = torch.Generator().manual_seed(7)
    w13q, s13 = quantize_blocks(0.2 * torch.randn(E, 2 * inter, hidden, generator=g))
    w2q, s2 = quantize_blocks(0.2 * torch.randn(E, hidden, inter, generator=g))
    s13 = s13 * torch.linspace(0.5, 2.0, s13.numel()).view(s13.shape)  # distinct scales: a wrong block shows
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = routed(tokens, seed=tokens)
    got = fused_experts_triton(x.to(DEVICE), w13q.to(DEVICE), w2q.to(DEVICE), weights, ids,
                               w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE))
    ref = fused_experts_ref(x, dequantize_blocks(w13q, s13), dequantize_blocks(w2q, s2), weights.cpu(), ids.cpu())
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)


def test_config_table_tuned_buckets_then_heuristic(monkeypatch):
    import ketch.kernels.fused_moe as fm

    monkeypatch.setattr(fm, "interpreting", lambda: False)
    for tokens in (1, 64, 512, 8192):  # the heuristic: every K step inside one fp8 scale block
        cfg = pick_config(tokens, 128, 2048, 768, 8, "fp8")
        assert cfg.block_m >= 16 and all(FP8_BLOCK % g.block_k == 0 for g in (cfg.up, cfg.down))
    small, large = (fm.MoEConfig(m, fm.GemmConfig(32, 64, 4, 3), fm.GemmConfig(64, 64, 4, 3)) for m in (16, 64))
    monkeypatch.setitem(fm.TUNED, (128, 2048, 768, 8, "16"), ((8, small), (256, large)))
    assert [pick_config(t, 128, 2048, 768, 8, "16") for t in (1, 8, 9, 256)] == [small, small, large, large]
    assert pick_config(257, 128, 2048, 768, 8, "16") == pick_config(257, 128, 2048, 768, 8, "fp8")  # past the table


@pytest.mark.skipif(sys.platform != "linux", reason="the triton wheel's ptxas")
def test_kernels_compile_for_sm90_without_spills():
    """The compiler sees what the interpreter does not (layouts, register pressure): the gated
    and the weighted GEMM at the Qwen3-30B-A3B shape's decode configs (aligned, and direct as a
    lone token takes them), the fp8 gated one (two
    accumulators and the scales) and the prefill down GEMM (the widest tile), each as the JIT
    builds it for the models (N and K multiples of 16: the K steps pipelined through cp.async
    stages in shared memory, which must fit; without that divisibility it would check a
    different, unpipelined kernel of twice the registers); the one-CTA
    alignment kernel, the softmax top-k routing kernel at the models' expert counts and the
    combine (which loads nothing before the PDL wait: its rows are the down GEMM's output)."""
    script = """
import triton
from ketch.kernels.compile_check import _compile, _usage
from ketch.kernels.fused_moe import _moe_gemm_kernel as fn, pick_config
for tokens, kind, which, direct in ((1, "16", "up down", True), (1, "16", "up down", False), (512, "fp8", "up", False),
                                   (4096, "16", "down", False)):
    cfg = pick_config(tokens, 128, 2048, 768, 8, kind)
    for gated, g in [(w == "up", getattr(cfg, w)) for w in which.split()]:
        consts = dict(A_ROW_DIV=8 if gated else 1, GATED=gated, MUL_WEIGHT=not gated, FP8=kind == "fp8", UPCAST=False,
                      DIRECT=direct,
                      PRECISION="tf32", BLOCK_M=cfg.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, USE_PDL=True)
        sig = {n: "*i32" for n in ("SortedIds", "ExpertIds", "NumPostPad")}
        sig.update(A="*bf16", C="*bf16", W="*fp8e4nv" if kind == "fp8" else "*bf16", Scale="*fp32", TopkWeights="*fp32")
        sig.update({n: "i32" for n in fn.arg_names if n not in sig})
        u = _usage("moe", _compile(fn, sig, consts, 90, g.num_warps, g.num_stages, aligned=("N", "K")))
        print(tokens, kind, gated, u.registers, u.spill_bytes, u.stores_before_wait, u.shared_bytes)
        assert u.spill_bytes == 0 and u.stores_before_wait == 0, u
        assert u.pipelined(), u
from ketch.kernels.moe_align import _moe_align_kernel
from ketch.kernels.moe_route import _softmax_topk_kernel
sig = {"TopkIds": "*i64", "SortedIds": "*i32", "ExpertIds": "*i32", "NumPostPad": "*i32", "rows": "i32", "total": "i32"}
for experts, chunk in ((128, 32), (64, 64), (256, 16)):  # moe_align's chunks for Qwen3 / DeepSeek-V2 / V3
    for early in (False, True):  # KETCH_PDL_EARLY: the dependents' launch before the wait
        consts = dict(NUM_EXPERTS=experts, BLOCK_M=16, BLOCK_E=experts, CHUNK=chunk, FILL=1024, USE_PDL=True,
                      EARLY_TRIGGER=early)
        u = _usage("align", _compile(_moe_align_kernel, sig, consts, 90, 4, 1))
        print("align", experts, u.registers, u.spill_bytes, u.stores_before_wait, u.trigger_first)
        assert u.spill_bytes == 0 and u.stores_before_wait == 0 and u.trigger_first == early, u
sig = {"Logits": "*bf16", "Weights": "*fp32", "Ids": "*i64", "Counts": "*i64", "CountRows": "*i64", "stride_l": "i32",
       "scale": "fp32"}
for experts, top_k, append in ((128, 8, 0), (8, 2, 0), (64, 6, 2)):  # Qwen3-30B-A3B, Mixtral, V2-Lite + shared
    consts = dict(NUM_EXPERTS=experts, TOP_K=top_k, APPEND=append, K_PAD=triton.next_power_of_2(top_k + append),
                  RENORMALIZE=True, BLOCK_E=experts, COUNT=True, COUNT_ROWS=True, USE_PDL=True)
    for early in (False, True):
        u = _usage("route", _compile(_softmax_topk_kernel, sig, {**consts, "EARLY_TRIGGER": early}, 90, 1, 1))
        print("route", experts, u.registers, u.spill_bytes, u.stores_before_wait, u.trigger_first)
        assert u.spill_bytes == 0 and u.stores_before_wait == 0 and u.trigger_first == early, u
from ketch.kernels.moe_combine import _moe_sum_kernel
sig = {"X": "*bf16", "Out": "*bf16", "stride_t": "i32", "stride_k": "i32", "stride_o": "i32"}
for top_k, hidden in ((8, 2048), (6, 2048), (2, 4096)):  # Qwen3-30B-A3B, DeepSeek-V2-Lite, Mixtral
    for early in (False, True):
        consts = dict(TOP_K=top_k, HIDDEN=hidden, BLOCK=1024, USE_PDL=True, EARLY_TRIGGER=early)
        u = _usage("combine", _compile(_moe_sum_kernel, sig, consts, 90, 4, 3))
        print("combine", top_k, u.registers, u.spill_bytes, u.loads_before_wait, u.stores_before_wait, u.trigger_first)
        assert u.spill_bytes == 0 and u.loads_before_wait == 0 and u.stores_before_wait == 0, u
        assert u.trigger_first == early, u
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_moe_layer_picks_the_kernel_at_build():
    """MoE(ops=triton_ops()) runs the fused kernel and its router through the ops' linear (the
    skinny GEMM for decode-sized steps; no branch in forward), MoE() the torch path; the two give
    the same output, at a decode-sized step and a larger one."""
    from functools import partial

    from ketch.layers.moe import MoE, torch_experts
    from ketch.layers.ops import triton_ops

    select = partial(softmax_topk, top_k=K, renormalize=True)
    ops = triton_ops()
    torch_moe, triton_moe = MoE(H, E, I, select), MoE(H, E, I, select, ops=ops)
    assert torch_moe.run_experts is torch_experts and triton_moe.run_experts is fused_experts_triton
    assert triton_moe.gate.dense is ops.linear and torch_moe.gate.dense is F.linear
    w13, w2 = experts(torch.float32, seed=3)
    gate = torch.randn(E, H, generator=torch.Generator().manual_seed(4))
    for moe in (torch_moe, triton_moe):
        moe.to(DEVICE)
        with torch.no_grad():
            moe.gate.weight.copy_(gate)
            moe.experts.w13.copy_(w13)
            moe.experts.w2.copy_(w2)
    for tokens in (2, 9):
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        with torch.no_grad():
            torch.testing.assert_close(triton_moe(x), torch_moe(x), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_and_replays_in_a_cuda_graph():
    """The decode path: nothing reads back to the host (torch's sync debug mode raises on a
    sync), and a captured graph replayed on new routing gives the reference."""
    w13, w2 = experts(torch.bfloat16)
    x = torch.randn(6, H, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = routed(6, seed=20)
    fused_experts_triton(x, w13, w2, weights, ids)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_experts_triton(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_experts_triton(x, w13, w2, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_triton(x, w13, w2, weights, ids)
    new_w, new_ids = routed(6, seed=21)
    x.copy_(torch.randn(6, H, device=DEVICE, dtype=torch.bfloat16))
    weights.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(out.float(), fused_experts_ref(x, w13, w2, weights, ids).float(), atol=2e-2, rtol=2e-2)


def test_a_moe_model_with_the_triton_layer_kernels_gives_the_torch_tokens(tmp_path):
    """End to end: Qwen3-30B-A3B's config cut small (dummy weights, fp32), greedy tokens and
    their logprobs with layer_kernels="triton" (the fused MoE kernel in every sparse layer; in
    the interpreter here) equal the torch layer kernels'."""
    import json
    from pathlib import Path

    from ketch.llm import LLM
    from ketch.sampling.params import SamplingParams
    from ketch.weights.source import default_model_path

    try:  # the dummy checkpoint has no tokenizer files: the bundled model's (absent on the GPU machine)
        tokenizer = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"no tokenizer for the dummy checkpoint: {e}")
    d = json.loads((Path(__file__).resolve().parents[1] / "configs" / "qwen3-30b-a3b" / "config.json").read_text())
    d.update(num_hidden_layers=2, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, num_experts=8)
    (tmp_path / "config.json").write_text(json.dumps(d))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True)
    runs, threads = {}, torch.get_num_threads()
    for kernels in ("torch", "triton"):
        llm = LLM(str(tmp_path / "config.json"), dtype="float32", load_format="dummy", kv_cache_memory=4 << 20,
                  page_size=8, tokenizer=tokenizer, num_threads=1, attention_backend="torch",
                  layer_kernels=kernels, device=DEVICE.type, cuda_graph=False)
        runs[kernels] = llm.generate([[5, 6, 7, 8, 9], [11, 12]], params)
        torch.set_num_threads(threads)  # LLM(num_threads=1) sets torch's global count
    for t, r in zip(runs["triton"], runs["torch"], strict=True):
        assert t.token_ids == r.token_ids
        # the values (pytest.approx compares TokenLogprob objects with ==: bit equality, which
        # the CPU's kernels, AMX or not, do not promise)
        assert [lp.token_id for lp in t.logprobs] == [lp.token_id for lp in r.logprobs]
        assert [lp.logprob for lp in t.logprobs] == pytest.approx([lp.logprob for lp in r.logprobs], abs=1e-4)
