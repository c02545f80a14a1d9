"""GPU: the engine on CUDA against HF transformers built from the identical random weights.

Shapes: a 4-layer slice of Llama-3.1-8B (every dimension real, fewer layers) and the full
model, each in fp32 and bf16. Prompts are random token ids; 16 prompts, 32 greedy tokens.

Every comparison is checked step by step while both sides still share their context
("teacher-forced"): the logits at a step are compared only while the tokens before it agree,
and where the greedy tokens part, the reference's logits at that step say how close a call it
was.

fp32: the noise is ~1e-5, so the bounds are fixed: logits within 1e-3 of the largest logit,
divergences only at a reference top-two gap of at most 1e-3, and >= 90 % of the prompts
identical (issue 4's criterion).

bf16: the bound is measured in the same run, never a constant (issue 12). The reference is HF
transformers in fp32 on the same (bf16-valued) weights; the yardstick is HF transformers in
bf16 against that reference (`hf_refs`, once per shape). Every bf16 run of ketch (bs1, batched,
with or without prefix hits, Triton or torch path, graphs or eager) is held to it by
`check_bf16`:
- logits: over the steps where ketch, HF bf16 and the reference all share their context,
  ketch's max |Δlogit| / max |logit| against the reference is at most 1.1 × HF bf16's over the
  same steps;
- divergences: where ketch's greedy token first leaves the reference's (prompt p, step s; the
  context is still shared there), let a be the reference's token, b ketch's, and
  gap = ref[a] − ref[b] >= 0 in the reference's fp32 logits. The divergence must be one of
    (H) where HF's own bf16 diverges too: HF bf16 left the reference on prompt p at step s or
        before it;
    (T) a tie within one bf16 ulp: gap <= ulp(ref[a]) = 2^(floor(log2 |ref[a]|) − 7), the
        spacing of bf16 numbers at the top logit, so rounding the two logits alone can swap
        them;
    (N) within HF bf16's own rounding noise at that step: gap <= 5 · √2 · σ, where σ is the RMS
        over the vocabulary of HF bf16's logit error against the reference at (p, s) (HF bf16
        still shares the context there, else (H) holds). The lm_head rows are random, so a
        step's logit error is Gaussian across the vocabulary; the error on the difference of
        two logits has standard deviation √2·σ, and ketch's σ is held near HF's by the logit
        check. A pure rounding flip beyond 5 of those (~3e-7 a pair) is not noise. Z = 5 is
        chosen from that tail, not fitted to any run.
  (H) and (T) alone do not suffice: bf16 rounding in ketch and in HF is independent (ketch vs
  HF bf16 differ as much as either does from fp32), so ketch flips near-ties at steps where
  HF's bf16 happens not to (run 12: at 32 layers ketch left fp32 after 5.1 tokens on average,
  HF bf16 after 7.6, with ketch's logit error the smaller). Each divergence is printed with the
  clause that explains it, and the count that needed (N).
Before issue 12, bf16 had fixed bounds (near-tie gap 0.5, logit error 10 %) loosened after
failures, and a yardstick that let ketch be 1.5× worse than HF's own bf16.

The engine under test is the CUDA default: Triton attention and layer kernels, decode CUDA
graphs captured at init. It is also compared with the torch path (SDPA over gathered pages,
torch norms/RoPE/SiLU), each backend's graphs with its own eager decode (bit-identical on the
Triton path: same kernels, same arguments; identical tokens on the torch path), and overlap
scheduling (the CUDA default) with the plain loop (bit-identical). The figures are printed
(pytest -s) for docs/performance.md.

The run helpers are in tests/gpu_util.py, the comparisons and bounds in tests/gpu_compare.py;
the tests stay in one module because they share its per-shape engine and HF references (module
fixtures: building the full 8B model and HF's runs once per shape is most of the run time).

Skips cleanly without CUDA.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gpu_compare import bit_identical, check_bf16, check_fp32, compare
from gpu_util import (
    DEVICE,
    NUM_PROMPTS,
    Run,
    build_hf,
    engine_greedy,
    hf_greedy,
    make_engine,
    make_prompts,
    release,
    sliced_config,
)

from ketch.engine.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = [(4, "float32"), (4, "bfloat16"), (32, "bfloat16"), (32, "float32")]


@pytest.fixture(scope="module", params=SHAPES, ids=["4-layer-fp32", "4-layer-bf16", "full-8B-bf16", "full-8B-fp32"])
def setup(request, tmp_path_factory):
    layers, dtype = request.param
    path = sliced_config(tmp_path_factory.mktemp("cfg"), layers)
    engine = make_engine(path, dtype)
    prompts = make_prompts(engine.vocab_size)
    yield path, engine, prompts, dtype
    del engine
    release()  # the full model in fp32 is 32 GB: free it before the next shape loads


@pytest.fixture(scope="module")
def hf_refs(setup) -> dict[torch.dtype, Run]:
    """HF transformers' greedy runs on the engine's exact weights, once per shape: in fp32 (the
    reference; the bf16 weights cast exactly) and, for bf16 shapes, in bf16 (the yardstick)."""
    path, engine, prompts, dtype = setup
    refs = {}
    for ref_dtype in (torch.float32, torch.bfloat16) if dtype == "bfloat16" else (torch.float32,):
        hf = build_hf(path, engine, DEVICE, dtype=ref_dtype)
        try:
            refs[ref_dtype] = hf_greedy(hf, prompts, DEVICE)
        finally:
            del hf
            release()
    yield refs
    refs.clear()
    release()


def test_weights_and_kv_live_on_the_gpu(setup):
    _, engine, _, dtype = setup
    want = getattr(torch, dtype)
    assert all(p.device.type == DEVICE and p.dtype == want for p in engine.runner.model.parameters())
    assert engine.runner.model.rotary.cos.dtype == torch.float32  # rotary tables stay fp32
    assert engine.runner.pool.k[0].device.type == DEVICE and engine.runner.pool.k[0].dtype == want
    # the CUDA defaults: Triton kernels, decode graphs captured at init for every padded size
    assert engine.runner.attention_backend == "triton" and engine.runner.ops.name == "triton"
    assert engine.runner.graphs.captured_sizes() == [1, 2, 4, 8, 16]


def test_greedy_matches_hf_transformers(setup, hf_refs):
    """fp32: ketch against HF fp32. bf16: ketch against HF fp32, held to HF's own bf16 (the yardstick)."""
    _, engine, prompts, dtype = setup
    ours = engine_greedy(engine, prompts, batched=False, tag="hf-parity")
    name = f"ketch ({engine.model_config.num_layers} layers, bs1)"
    if dtype == "float32":
        check_fp32(compare(hf_refs[torch.float32], ours), f"{name} vs HF transformers")
        return
    check_bf16(ours, name, hf_refs)
    print("[bfloat16] (reported) " + compare(hf_refs[torch.bfloat16], ours).line(f"{name} vs HF bf16"))


def test_batching_and_prefix_cache_do_not_change_greedy_output(setup, hf_refs):
    path, engine, prompts, dtype = setup
    one = engine_greedy(engine, prompts, batched=False, tag="bs1")  # odd prompts hit the shared prefix
    batched = engine_greedy(engine, prompts, batched=True, tag="batched")  # every full prompt page hits
    assert engine.scheduler.stats.cached_prompt_tokens > 0
    off = make_engine(path, dtype, enable_prefix_cache=False)
    try:
        no_cache = engine_greedy(off, prompts, batched=True, tag="nocache")
        assert off.scheduler.stats.cached_prompt_tokens == 0
    finally:
        del off
        release()
    pairs = [(one, batched, "ketch bs1 vs batched (prefix cache on)"),
             (no_cache, batched, "ketch batched: prefix cache off vs on (hits)")]
    if dtype == "float32":
        for ref, other, name in pairs:
            check_fp32(compare(ref, other), name)
        return
    # bf16: two ketch runs differ by rounding as ketch and HF do; each is held to the yardstick
    for run, name in ((one, "ketch bs1, prefix hits"), (batched, "ketch batched, prefix hits"),
                      (no_cache, "ketch batched, prefix cache off")):
        check_bf16(run, name, hf_refs)
    for ref, other, name in pairs:
        print("[bfloat16] (reported) " + compare(ref, other).line(name))


def test_triton_path_matches_torch_path(setup, hf_refs):
    """Default engine (Triton kernels, graphs) against the torch reference path, eager."""
    path, engine, prompts, dtype = setup
    ours = engine_greedy(engine, prompts, batched=True, tag="triton")
    ref_engine = make_engine(path, dtype, attention_backend="torch", layer_kernels="torch", cuda_graph=False)
    try:
        ref = engine_greedy(ref_engine, prompts, batched=True, tag="torch")
    finally:
        del ref_engine
        release()
    name = "Triton kernels + graphs vs torch path (batched)"
    if dtype == "float32":
        check_fp32(compare(ref, ours), name)
        return
    check_bf16(ours, "ketch Triton kernels + graphs (batched)", hf_refs)
    check_bf16(ref, "ketch torch path, eager (batched)", hf_refs)
    print("[bfloat16] (reported) " + compare(ref, ours).line(name))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graph_decode_matches_eager(setup, hf_refs, backend):
    """Triton: bit-identical tokens and logits (the decode split count depends on the batch size
    only, so a graph of n rows and an eager step of n rows launch the same kernels with the same
    arguments). torch: identical tokens (its GEMMs may pick other algorithms under capture)."""
    path, _, prompts, dtype = setup
    runs = {}
    for graph in (False, True):  # prefix cache off: both sides prefill every prompt the same way
        engine = make_engine(path, dtype, enable_prefix_cache=False, cuda_graph=graph,
                             attention_backend=backend, layer_kernels=backend)
        calls: list[int] = []
        if graph:
            replay = engine.runner.graphs.run
            engine.runner.graphs.run = lambda chunks: calls.append(len(chunks)) or replay(chunks)
        try:
            runs[graph] = (engine_greedy(engine, prompts, batched=False, tag="one"),
                           engine_greedy(engine, prompts, batched=True, tag="all"))
        finally:
            del engine
            release()
    assert {1, NUM_PROMPTS} <= set(calls)  # both runs really decoded through graphs
    for i, size in enumerate(("bs1", "batched")):
        eager, graph = runs[False][i], runs[True][i]
        cmp = compare(eager, graph)
        name = f"{backend}: CUDA graph vs eager decode, {size}"
        print(f"\n[{dtype}] " + cmp.line(name))
        assert cmp.identical == NUM_PROMPTS, cmp.line(name)
        if backend == "triton":
            assert bit_identical(eager, graph), cmp.line(name)
        elif dtype == "float32":
            check_fp32(cmp, name)
        else:
            check_bf16(eager, f"ketch torch path, eager, {size}", hf_refs)
            check_bf16(graph, f"ketch torch path, graphs, {size}", hf_refs)


def _busy_after_step(engine: Engine, prompts: list[list[int]], tag: str) -> tuple[Run, float]:
    """Greedy batched run; the fraction of decode-step returns at which the GPU was still busy."""
    busy: list[bool] = []
    step = engine.step

    def watched():
        outs = step()
        if sum(len(o.new_token_ids) for o in outs) == len(prompts):  # a whole decode step came back
            busy.append(not torch.cuda.current_stream().query())
        return outs

    engine.step = watched
    try:
        run = engine_greedy(engine, prompts, batched=True, tag=tag)
    finally:
        del engine.step
    return run, sum(busy) / max(1, len(busy))


def test_overlap_schedule_matches_the_plain_loop(setup):
    """Overlap on (the CUDA default) against off: identical tokens and logits, bs1 and batched.
    All requests run to the same length, so both loops run the same batches step for step.
    With overlap the host returns from a step while the GPU computes the next one; without it
    the GPU is idle whenever the host is."""
    path, _, prompts, dtype = setup
    runs, busy = {}, {}
    for overlap in (False, True):
        engine = make_engine(path, dtype, enable_prefix_cache=False, overlap_schedule=overlap)
        try:
            assert engine.overlap is overlap
            one = engine_greedy(engine, prompts, batched=False, tag="one")
            batched, busy[overlap] = _busy_after_step(engine, prompts, "all")
            runs[overlap] = (one, batched)
        finally:
            del engine
            release()
    for i, size in enumerate(("bs1", "batched")):
        cmp = compare(runs[False][i], runs[True][i])
        print(f"\n[{dtype}] " + cmp.line(f"overlap on vs off, {size}"))
        assert bit_identical(runs[False][i], runs[True][i]), cmp.line(size)
    print(f"\n[{dtype}] GPU still busy when a decode step returns: overlap off {busy[False]:.0%}, on {busy[True]:.0%}")
    assert busy[False] == 0  # each step waited for its own tokens: nothing left queued
    layers = json.loads(Path(path).read_text())["num_hidden_layers"]
    if layers == 32:  # a 5+ ms step: the host is always ahead of it
        assert busy[True] >= 0.9
