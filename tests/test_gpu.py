"""GPU: the engine on CUDA against HF transformers built from the identical random weights.

Shapes: a 4-layer slice of Llama-3.1-8B (every dimension real, fewer layers) and the full
model, each in fp32 and bf16. Prompts are random token ids; 16 prompts, 32 greedy tokens.

Every comparison is checked step by step while both sides still share their context
("teacher-forced"): the logits must agree to the dtype's noise, and where the greedy tokens
part, the reference's top-two gap there must be a near-tie. In fp32 that noise is ~1e-5, so
the tokens must also be identical for >= 90% of the prompts (issue 4's criterion). In bf16 the
random model's top two logits over a 128K vocabulary are often closer than its rounding noise,
so the identical count is reported, not asserted: on an H200 (2026-11-29) ketch vs ketch
(bs1 vs batched) and ketch vs HF differed alike, by up to 1.9% of the largest logit with 4
layers and 4.8% / 6.8% with 32, every divergence at a top-two gap of at most 0.22 (7 ulps)
on the torch path; the Triton path against HF reached 8.3% and a gap of 0.31 (10 ulps), and
against the torch path 8.0% and 0.22. A token can only flip where the gap is at most twice
the logit difference at that step, so the near-tie bound is a bound on that difference at the
divergence points; bf16's is 0.5 (16 ulps, under 10% of the largest logit, ~5.4).
The figures are printed (pytest -s) for docs/performance.md.

The engine under test is the CUDA default: Triton attention and layer kernels, decode CUDA
graphs captured at init. It is also compared with the torch path (SDPA over gathered pages,
torch norms/RoPE/SiLU), each backend's graphs with its own eager decode (identical tokens), and
overlap scheduling (the CUDA default) with the plain loop (identical tokens).

Skips cleanly without CUDA.
"""
from __future__ import annotations

import dataclasses
import gc
import inspect
import json
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


@dataclasses.dataclass(frozen=True)
class Tolerance:
    logit_rel: float  # max |Δlogit| on a shared context over the largest |logit| of that step
    near_tie: float  # a divergence must happen where the reference's top-two logits are this close
    min_identical: float | None  # fraction of prompts whose 32 tokens must be identical


TOLERANCE = {
    "float32": Tolerance(logit_rel=1e-3, near_tie=1e-3, min_identical=0.9),
    # one bf16 ulp at |logit| in [4, 8) is 0.03; 32 random layers of bf16 rounding reach ~10 ulps
    "bfloat16": Tolerance(logit_rel=0.1, near_tie=0.5, min_identical=None),
}


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
    for p, (rt, ot) in enumerate(zip(ref.tokens, other.tokens)):
        assert len(rt) == len(ot) == NEW_TOKENS
        diverge = next((s for s, (a, b) in enumerate(zip(rt, ot)) if a != b), None)
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


def check(cmp: Comparison, name: str, dtype: str) -> None:
    tol = TOLERANCE[dtype]
    print(f"\n[{dtype}] " + cmp.line(name))
    assert cmp.max_rel_diff <= tol.logit_rel, cmp.line(name)
    assert all(gap <= tol.near_tie for _, _, gap in cmp.divergences), cmp.line(name)
    if tol.min_identical is not None:
        assert cmp.identical >= tol.min_identical * NUM_PROMPTS, cmp.line(name)


SHAPES = [(4, "float32"), (4, "bfloat16"), (32, "bfloat16"), (32, "float32")]


@pytest.fixture(scope="module", params=SHAPES, ids=["4-layer-fp32", "4-layer-bf16", "full-8B-bf16", "full-8B-fp32"])
def setup(request, tmp_path_factory):
    layers, dtype = request.param
    path = sliced_config(tmp_path_factory.mktemp("cfg"), layers)
    engine = make_engine(path, dtype)
    prompts = make_prompts(engine.vocab_size)
    yield path, engine, prompts, dtype
    del engine
    gc.collect()  # the full model in fp32 is 32 GB: free it before the next shape loads
    torch.cuda.empty_cache()


def test_weights_and_kv_live_on_the_gpu(setup):
    _, engine, _, dtype = setup
    want = getattr(torch, dtype)
    assert all(p.device.type == DEVICE and p.dtype == want for p in engine.runner.model.parameters())
    assert engine.runner.model.rotary.cos.dtype == torch.float32  # rotary tables stay fp32
    assert engine.runner.pool.k[0].device.type == DEVICE and engine.runner.pool.k[0].dtype == want
    # the CUDA defaults: Triton kernels, decode graphs captured at init for every padded size
    assert engine.runner.attention_backend == "triton" and engine.runner.ops.name == "triton"
    assert engine.runner.graphs.captured_sizes() == [1, 2, 4, 8, 16]


def test_greedy_matches_hf_transformers(setup):
    path, engine, prompts, dtype = setup
    ours = engine_greedy(engine, prompts, batched=False, tag="hf-parity")
    hf = build_hf(path, engine, DEVICE)
    try:
        ref = hf_greedy(hf, prompts, DEVICE)
    finally:
        del hf
        torch.cuda.empty_cache()
    check(compare(ref, ours), f"ketch vs HF transformers ({engine.model_config.num_layers} layers, bs1)", dtype)


def _tokens_before_divergence(ref: Run, other: Run) -> list[int]:
    return [next((s for s, (a, b) in enumerate(zip(rt, ot)) if a != b), NEW_TOKENS)
            for rt, ot in zip(ref.tokens, other.tokens)]


def _agreed(ref: Run, other: Run) -> list[int]:
    """Per prompt, the steps whose logits share their context: up to and including the first divergence."""
    return [min(n + 1, NEW_TOKENS) for n in _tokens_before_divergence(ref, other)]


def _rel_error(ref: Run, other: Run, horizon: list[int]) -> float:
    """max |Δlogit| / max |logit| over each prompt's first horizon[p] steps."""
    return max(float((ref.logits[p][s] - other.logits[p][s]).abs().max() / ref.logits[p][s].abs().max())
               for p in range(len(horizon)) for s in range(horizon[p]))


def test_bf16_is_as_close_to_fp32_as_hf_transformers_bf16(setup):
    """The yardstick for bf16: HF transformers in fp32 on the same (bf16-valued) weights is the
    reference; ketch in bf16 must be no further from it than HF transformers in bf16 is. Random
    weights have near-ties that bf16 rounding flips (module docstring), so "identical tokens" is
    reported for both, and the assertion is on the logit error over the steps where all three
    runs still share their context."""
    path, engine, prompts, dtype = setup
    if dtype != "bfloat16":
        pytest.skip("a bf16 yardstick")
    ours = engine_greedy(engine, prompts, batched=False, tag="yardstick")
    refs = {}
    for ref_dtype in (torch.float32, torch.bfloat16):
        hf = build_hf(path, engine, DEVICE, dtype=ref_dtype)
        try:
            refs[ref_dtype] = hf_greedy(hf, prompts, DEVICE)
        finally:
            del hf
            torch.cuda.empty_cache()
    fp32, hf16 = refs[torch.float32], refs[torch.bfloat16]
    horizon = [min(a, b) for a, b in zip(_agreed(fp32, ours), _agreed(fp32, hf16))]
    mine, theirs = _rel_error(fp32, ours, horizon), _rel_error(fp32, hf16, horizon)
    layers = engine.model_config.num_layers
    for name, run in (("HF bf16", hf16), ("ketch bf16", ours)):
        before = _tokens_before_divergence(fp32, run)
        print(f"\n[yardstick, {layers} layers] {name} vs HF fp32: identical {compare(fp32, run).identical}/"
              f"{NUM_PROMPTS}, mean tokens before the first divergence {sum(before) / NUM_PROMPTS:.1f}")
    print(f"[yardstick, {layers} layers] max |Δlogit| / max |logit| vs HF fp32 on shared steps: "
          f"ketch bf16 {mine:.2%}, HF bf16 {theirs:.2%}; " + compare(hf16, ours).line("ketch bf16 vs HF bf16"))
    assert mine <= 1.5 * theirs, (mine, theirs)


def test_batching_and_prefix_cache_do_not_change_greedy_output(setup):
    path, engine, prompts, dtype = setup
    one = engine_greedy(engine, prompts, batched=False, tag="bs1")  # odd prompts hit the shared prefix
    batched = engine_greedy(engine, prompts, batched=True, tag="batched")  # every full prompt page hits
    assert engine.scheduler.stats.cached_prompt_tokens > 0
    check(compare(one, batched), "ketch bs1 vs batched (prefix cache on)", dtype)
    off = make_engine(path, dtype, enable_prefix_cache=False)
    try:
        no_cache = engine_greedy(off, prompts, batched=True, tag="nocache")
        assert off.scheduler.stats.cached_prompt_tokens == 0
    finally:
        del off
        torch.cuda.empty_cache()
    check(compare(no_cache, batched), "ketch batched: prefix cache off vs on (hits)", dtype)


def test_triton_path_matches_torch_path(setup):
    """Default engine (Triton kernels, graphs) against the torch reference path, eager."""
    path, engine, prompts, dtype = setup
    ours = engine_greedy(engine, prompts, batched=True, tag="triton")
    ref_engine = make_engine(path, dtype, attention_backend="torch", layer_kernels="torch", cuda_graph=False)
    try:
        ref = engine_greedy(ref_engine, prompts, batched=True, tag="torch")
    finally:
        del ref_engine
        torch.cuda.empty_cache()
    check(compare(ref, ours), "Triton kernels + graphs vs torch path (batched)", dtype)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graph_decode_matches_eager(setup, backend):
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
            torch.cuda.empty_cache()
    assert {1, NUM_PROMPTS} <= set(calls)  # both runs really decoded through graphs
    for i, name in enumerate(("bs1", "batched")):
        cmp = compare(runs[False][i], runs[True][i])
        check(cmp, f"{backend}: CUDA graph vs eager decode, {name}", dtype)
        assert cmp.identical == NUM_PROMPTS, cmp.line(name)  # same kernels, same split counts: same tokens


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
            torch.cuda.empty_cache()
    for i, name in enumerate(("bs1", "batched")):
        cmp = compare(runs[False][i], runs[True][i])
        check(cmp, f"overlap on vs off, {name}", dtype)
        assert cmp.identical == NUM_PROMPTS and cmp.max_abs_diff == 0, cmp.line(name)
    print(f"\n[{dtype}] GPU still busy when a decode step returns: overlap off {busy[False]:.0%}, on {busy[True]:.0%}")
    assert busy[False] == 0  # each step waited for its own tokens: nothing left queued
    layers = json.loads(Path(path).read_text())["num_hidden_layers"]
    if layers == 32:  # a 5+ ms step: the host is always ahead of it
        assert busy[True] >= 0.9
