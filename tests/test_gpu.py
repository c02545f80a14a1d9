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

Skips cleanly without CUDA.
"""
from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import math
import random
from pathlib import Path

import pytest
import torch

from conftest import collect, drain
from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams
from ketch.weights.dummy_loader import DummyWeights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LLAMA_8B = Path(__file__).resolve().parents[1] / "configs" / "llama-3.1-8b" / "config.json"
DEVICE = "cuda"
NUM_PROMPTS = 16
NEW_TOKENS = 32


# fp32 (fixed: its noise is ~1e-5): max |Δlogit| on a shared context over the largest |logit| of
# that step; the reference's top-two gap at a divergence; the fraction of prompts identical
FP32_LOGIT_REL, FP32_NEAR_TIE, FP32_MIN_IDENTICAL = 1e-3, 1e-3, 0.9
# bf16 (module docstring): ketch's logit error at most this times HF bf16's, measured in the same run
BF16_VS_HF = 1.1
# bf16 (N): a divergence within this many standard deviations of HF bf16's noise on a logit difference
NOISE_Z = 5.0


@dataclasses.dataclass
class Run:
    """One side of a comparison: per prompt, the greedy tokens and each step's fp32 logits."""

    tokens: list[list[int]]
    logits: list[list[torch.Tensor]]  # [prompt][step] -> [vocab] fp32


def sliced_config(tmp_path: Path, layers: int) -> str:
    d = json.loads(LLAMA_8B.read_text())
    d["num_hidden_layers"] = layers
    path = tmp_path / f"llama-3.1-8b-{layers}l.json"
    path.write_text(json.dumps(d))
    return str(path)


def make_engine(config_path: str, dtype: str, **kw) -> Engine:
    kw.setdefault("kv_cache_memory", 2 << 30)
    kw.setdefault("cuda_graph_max_bs", NUM_PROMPTS)  # captures 1, 2, 4, 8, 16: all this test decodes
    return Engine(EngineConfig(model=config_path, load_format="dummy", dtype=dtype, device=DEVICE,
                               max_model_len=1024, seed=0, **kw))


def make_prompts(vocab: int) -> list[list[int]]:
    """Random prompts; every other one starts with a shared 40-token prefix (2 full pages of 16),
    so a second pass over them hits the prefix cache."""
    rng = random.Random(1234)
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts = []
    for i in range(NUM_PROMPTS):
        own = [rng.randrange(vocab) for _ in range(rng.randint(8, 56))]
        prompts.append(shared + own if i % 2 else own)
    return prompts


class _LogitTap:
    """Records the fp32 logits the runner returns, per request, step by step."""

    def __init__(self, engine: Engine) -> None:
        self.runner = engine.runner
        self.forward = engine.runner.forward
        self.rows: dict[str, list[torch.Tensor]] = {}

    def __enter__(self) -> _LogitTap:
        def tapped(chunks):
            logits = self.forward(chunks)
            for row, c in enumerate(c for c in chunks if c.samples):
                self.rows.setdefault(c.req.rid, []).append(logits[row].clone())
            return logits

        self.runner.forward = tapped
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.forward  # the class's method again


def engine_greedy(engine: Engine, prompts: list[list[int]], batched: bool, tag: str) -> Run:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    groups = [range(len(prompts))] if batched else [[i] for i in range(len(prompts))]
    outs = []
    with _LogitTap(engine) as tap:
        for group in groups:
            for i in group:
                engine.add_request(f"{tag}-{i}", prompts[i], params)
            outs += drain(engine)
    res = collect(outs)
    return Run([res[(f"{tag}-{i}", 0)]["ids"] for i in range(len(prompts))],
               [tap.rows[f"{tag}-{i}"] for i in range(len(prompts))])


def build_hf(config_path: str, engine: Engine, device: str, dtype: torch.dtype | None = None):
    """HF LlamaForCausalLM of the same config holding the same dummy tensors (same seed and device),
    in the engine's dtype or in `dtype` (the engine's tensors cast exactly, e.g. bf16 → fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**json.loads(Path(config_path).read_text()))
    dtype = dtype or engine.runner.dtype
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(saved)
    weights = DummyWeights(engine.model_config, engine.runner.dtype, seed=engine.config.seed, device=device)
    hf.load_state_dict({name: t.to(dtype) for name, t in weights}, strict=True)
    ours = engine.runner.model
    assert torch.equal(hf.model.embed_tokens.weight.to(ours.embed_tokens.weight.dtype), ours.embed_tokens.weight)
    assert torch.equal(hf.lm_head.weight.to(ours.lm_head.weight.dtype), ours.lm_head.weight)
    q = hf.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q.to(ours.embed_tokens.weight.dtype), ours.layers[0].self_attn.qkv_proj.weight[: q.shape[0]])
    return hf.eval()


@torch.inference_mode()
def hf_greedy(hf, prompts: list[list[int]], device: str) -> Run:
    from transformers import DynamicCache

    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    tokens, logits = [], []
    for prompt in prompts:
        cache = DynamicCache()
        ids = torch.tensor([prompt], device=device)
        toks: list[int] = []
        steps: list[torch.Tensor] = []
        for _ in range(NEW_TOKENS):
            out = hf(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
            row = out.logits[0, -1].float()
            steps.append(row)
            toks.append(int(row.argmax()))
            ids = torch.tensor([[toks[-1]]], device=device)
        tokens.append(toks)
        logits.append(steps)
    return Run(tokens, logits)


@dataclasses.dataclass
class Comparison:
    identical: int
    max_abs_diff: float  # over all teacher-forced steps of all prompts
    max_rel_diff: float  # the same over the largest |logit| of that step
    first_step_max_abs_diff: float
    divergences: list[tuple[int, int, float]]  # (prompt, step, reference top-two gap)

    def line(self, name: str) -> str:
        gaps = ", ".join(f"p{p}@{s}:{g:.3g}" for p, s, g in self.divergences) or "none"
        return (f"{name}: identical {self.identical}/{NUM_PROMPTS}; max |Δlogit| first step "
                f"{self.first_step_max_abs_diff:.3g}, all shared steps {self.max_abs_diff:.3g} "
                f"({self.max_rel_diff:.2%} of max |logit|); divergences (prompt@step: ref gap) {gaps}")


def compare(ref: Run, other: Run) -> Comparison:
    identical, max_abs, max_rel, first = 0, 0.0, 0.0, 0.0
    divergences = []
    for p, (rt, ot) in enumerate(zip(ref.tokens, other.tokens, strict=True)):
        assert len(rt) == len(ot) == NEW_TOKENS
        diverge = next((s for s, (a, b) in enumerate(zip(rt, ot, strict=True)) if a != b), None)
        identical += diverge is None
        shared = NEW_TOKENS if diverge is None else diverge + 1  # logits at the divergence share context too
        for s in range(shared):
            r, o = ref.logits[p][s], other.logits[p][s]
            d = float((r - o).abs().max())
            max_abs, max_rel = max(max_abs, d), max(max_rel, d / float(r.abs().max()))
            if s == 0:
                first = max(first, d)
        if diverge is not None:
            r = ref.logits[p][diverge]
            divergences.append((p, diverge, float(r[rt[diverge]] - r[ot[diverge]])))
    return Comparison(identical, max_abs, max_rel, first, divergences)


def check_fp32(cmp: Comparison, name: str) -> None:
    print("\n[float32] " + cmp.line(name))
    assert cmp.max_rel_diff <= FP32_LOGIT_REL, cmp.line(name)
    assert all(gap <= FP32_NEAR_TIE for _, _, gap in cmp.divergences), cmp.line(name)
    assert cmp.identical >= FP32_MIN_IDENTICAL * NUM_PROMPTS, cmp.line(name)


def bit_identical(a: Run, b: Run) -> bool:
    return a.tokens == b.tokens and all(
        len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
        for x, y in zip(a.logits, b.logits, strict=True))


def _tokens_before_divergence(ref: Run, other: Run) -> list[int]:
    return [next((s for s, (a, b) in enumerate(zip(rt, ot, strict=True)) if a != b), NEW_TOKENS)
            for rt, ot in zip(ref.tokens, other.tokens, strict=True)]


def _agreed(ref: Run, other: Run) -> list[int]:
    """Per prompt, the steps whose logits share their context: up to and including the first divergence."""
    return [min(n + 1, NEW_TOKENS) for n in _tokens_before_divergence(ref, other)]


def _rel_error(ref: Run, other: Run, horizon: list[int]) -> float:
    """max |Δlogit| / max |logit| over each prompt's first horizon[p] steps."""
    return max(float((ref.logits[p][s] - other.logits[p][s]).abs().max() / ref.logits[p][s].abs().max())
               for p in range(len(horizon)) for s in range(horizon[p]))


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers (8 significant bits) at |x|: 2^(floor(log2 |x|) - 7)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 0.0


def check_bf16(run: Run, name: str, refs: dict[torch.dtype, Run]) -> None:
    """Hold a bf16 run of ketch to HF transformers' bf16, both against HF fp32 on the same weights
    (the bounds and clauses H, T, N are defined in the module docstring)."""
    fp32, hf16 = refs[torch.float32], refs[torch.bfloat16]
    ours_at, hf_at = _tokens_before_divergence(fp32, run), _tokens_before_divergence(fp32, hf16)
    horizon = [min(a, b) for a, b in zip(_agreed(fp32, run), _agreed(fp32, hf16), strict=True)]
    mine, theirs = _rel_error(fp32, run, horizon), _rel_error(fp32, hf16, horizon)
    notes, unexplained, only_noise = [], [], 0
    for p, s in enumerate(ours_at):
        if s == NEW_TOKENS:
            continue
        ref = fp32.logits[p][s]
        a, b = fp32.tokens[p][s], run.tokens[p][s]
        gap = float(ref[a] - ref[b])
        if hf_at[p] <= s:
            why = "H"
        elif gap <= bf16_ulp(float(ref[a])):
            why = "T"
        else:  # HF bf16 still shares the context at step s: its error there is its noise on this context
            sigma = float((hf16.logits[p][s] - ref).pow(2).mean().sqrt())
            bound = NOISE_Z * math.sqrt(2.0) * sigma
            why = f"N<={bound:.3g}" if gap <= bound else f"UNEXPLAINED>{bound:.3g}"
            only_noise += gap <= bound
            if gap > bound:
                unexplained.append((p, s, gap))
        notes.append(f"p{p}@{s}:{gap:.3g}({why})")
    identical = sum(n == NEW_TOKENS for n in ours_at)
    line = (f"{name} vs HF fp32: identical {identical}/{NUM_PROMPTS} (HF bf16 "
            f"{sum(n == NEW_TOKENS for n in hf_at)}/{NUM_PROMPTS}); mean tokens before the first "
            f"divergence {sum(ours_at) / NUM_PROMPTS:.1f} (HF bf16 {sum(hf_at) / NUM_PROMPTS:.1f}); "
            f"max |Δlogit| / max |logit| on steps all three share: {mine:.2%}, HF bf16 {theirs:.2%}, "
            f"ratio {mine / theirs:.3f} (bound {BF16_VS_HF}); divergences (prompt@step:fp32 gap(clause)) "
            f"{', '.join(notes) or 'none'}; needed (N): {only_noise} of {len(notes)}")
    print("\n[bfloat16] " + line)
    assert mine <= BF16_VS_HF * theirs, line
    assert not unexplained, line


SHAPES = [(4, "float32"), (4, "bfloat16"), (32, "bfloat16"), (32, "float32")]


def release() -> None:
    gc.collect()  # engines hold reference cycles (graph runners, patched methods): free them now
    torch.cuda.empty_cache()


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
