"""fp8 e4m3 KV on the GPU (skipped without CUDA): a 4-layer Llama-3.1-8B slice, fp8 vs bf16 KV,
and CUDA graphs vs eager under fp8."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest

pytest.importorskip("triton")

from conftest import collect, drain
from logit_tap import LogitTap

from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams

FP8 = torch.float8_e4m3fn

# ---------------------------------------------------------------- GPU

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LLAMA_8B = Path(__file__).resolve().parents[1] / "configs" / "llama-3.1-8b" / "config.json"
GPU_PROMPTS, GPU_NEW_TOKENS = 16, 32
# max |Δlogit| over the step's largest |logit|, fp8 vs bf16 KV, on steps sharing their context.
# Measured on the CPU (torch path, fp32 weights, fp8 vs fp32 KV) for this slice, seed and the
# first 8 of these prompts, 12 tokens: 12% at most, 8% on a first token read through a cached
# fp8 prefix (the random model's logits span only ~±6, so fp8's rounding weighs more than on
# SmolLM2). bf16 itself adds up to 1.9% on this slice (ketch vs HF, tests/test_gpu.py).
GPU_REL_BOUND = 0.25
# greedy tokens may part only at a near-tie of the reference: the CPU run parted at gaps <= 0.16;
# bf16's own bound in tests/test_gpu.py is 0.5
GPU_NEAR_TIE = 0.5


def _sliced_8b(tmp_path: Path, layers: int = 4) -> str:
    d = json.loads(LLAMA_8B.read_text())
    d["num_hidden_layers"] = layers  # every dimension real, fewer layers
    path = tmp_path / f"llama-3.1-8b-{layers}l.json"
    path.write_text(json.dumps(d))
    return str(path)


def _gpu_engine(path: str, **kw) -> Engine:
    return Engine(EngineConfig(model=path, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=1024,
                               seed=0, kv_cache_memory=2 << 30, cuda_graph_max_bs=GPU_PROMPTS, **kw))


def _gpu_prompts(vocab: int) -> list[list[int]]:
    """Random prompts; every other one starts with a shared 40-token prefix (with the prefix
    cache on, their prefill reads it back from fp8 pages)."""
    rng = random.Random(1234)
    shared = [rng.randrange(vocab) for _ in range(40)]
    return [(shared if i % 2 else []) + [rng.randrange(vocab) for _ in range(rng.randint(8, 56))]
            for i in range(GPU_PROMPTS)]


def _greedy_with_logits(engine: Engine, prompts: list[list[int]], tag: str,
                        batched: bool = True) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy tokens and every step's fp32 logits, per prompt; all at once or one at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=GPU_NEW_TOKENS, ignore_eos=True)
    outs = []
    with LogitTap(engine, keep=lambda row: row.float().cpu()) as tap:
        for group in [range(len(prompts))] if batched else [[i] for i in range(len(prompts))]:
            for i in group:
                engine.add_request(f"{tag}-{i}", prompts[i], params)
            outs += drain(engine)
    rows = tap.rows
    res = collect(outs)
    return [res[(f"{tag}-{i}", 0)]["ids"] for i in range(len(prompts))], [rows[f"{tag}-{i}"] for i in range(len(prompts))]


def _compare(ref, other, name: str) -> tuple[int, float, list[float]]:
    """Identical prompts, max relative |Δlogit| over the shared steps, the reference's top-two
    gaps where the tokens part; printed (pytest -s)."""
    identical, worst, gaps = 0, 0.0, []
    for p, (rt, ot) in enumerate(zip(ref[0], other[0], strict=True)):
        diverge = next((s for s, (a, b) in enumerate(zip(rt, ot)) if a != b), None)
        identical += diverge is None
        shared = GPU_NEW_TOKENS if diverge is None else diverge + 1
        for s in range(shared):
            r, o = ref[1][p][s], other[1][p][s]
            worst = max(worst, float((r - o).abs().max() / r.abs().max()))
        if diverge is not None:
            gaps.append(float(ref[1][p][diverge][rt[diverge]] - ref[1][p][diverge][ot[diverge]]))
    print(f"\n[4-layer Llama-3.1-8B slice, bf16] {name}: identical {identical}/{len(ref[0])}; max |Δlogit| / "
          f"max |logit| over shared steps {worst:.2%}; reference top-two gaps where they part {[round(g, 3) for g in gaps]}")
    return identical, worst, gaps


@cuda
def test_gpu_fp8_kv_stays_close_to_bf16_kv_and_graphs_match_eager(tmp_path):
    import gc

    path = _sliced_8b(tmp_path)
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    runs, pages = {}, {}
    # prefix cache on for fp8 vs bf16 (hits read fp8 pages in the extend kernel); off for graphs vs
    # eager, so both prefill every prompt the same way and decode the same batch sizes
    for name, kw, batched in (("bf16", {}, True), ("fp8", fp8, True),
                              ("fp8-graph-bs1", {**fp8, "enable_prefix_cache": False}, False),
                              ("fp8-eager-bs1", {**fp8, "enable_prefix_cache": False, "cuda_graph": False}, False),
                              ("fp8-graph", {**fp8, "enable_prefix_cache": False}, True),
                              ("fp8-eager", {**fp8, "enable_prefix_cache": False, "cuda_graph": False}, True)):
        engine = _gpu_engine(path, **kw)
        try:
            pool = engine.runner.pool
            assert engine.runner.attention_backend == "triton"
            assert pool.k[0].dtype == (torch.bfloat16 if name == "bf16" else FP8) and pool.compute_dtype == torch.bfloat16
            assert (engine.runner.graphs is None) == ("eager" in name)
            pages[name] = pool.num_pages
            runs[name] = _greedy_with_logits(engine, _gpu_prompts(engine.vocab_size), name, batched)
            if name == "fp8":
                assert engine.scheduler.stats.cached_prompt_tokens > 0
        finally:
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    assert pages["fp8"] == 2 * pages["bf16"]  # the same 2 GiB, half the bytes per page

    _, worst, gaps = _compare(runs["bf16"], runs["fp8"], "fp8 vs bf16 KV (batched, prefix cache on)")
    assert 0 < worst <= GPU_REL_BOUND
    assert all(g <= GPU_NEAR_TIE for g in gaps)
    # graphs vs eager under fp8: the same kernels and split counts at the captured sizes 1 and 16
    for mode in ("-bs1", ""):
        identical, worst, _ = _compare(runs[f"fp8-eager{mode}"], runs[f"fp8-graph{mode}"],
                                       f"fp8 KV: CUDA graph vs eager decode{mode or ' (batched)'}")
        assert identical == GPU_PROMPTS
        assert worst <= 0.1  # tests/test_gpu.py's bf16 bound for graphs vs eager; printed above
