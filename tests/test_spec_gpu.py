"""Speculative verify under CUDA graphs (verify rows are decode rows: the decode graphs of
(k + 1) x batch rows replay them). Known failure: verify in CUDA graphs crashed or went wrong
when the batch shrank (stale padding slots): 32 requests with staggered lengths, a pool small
enough to preempt, and aborts; greedy output equals the eager run without speculation, every
page comes back. `draft` runs its draft model on the GPU too, in its own CUDA graphs. Runs where
CUDA is (the CPU suite covers the same scenario without graphs)."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_drained, collect, drain, make_tiny_engine
from ketch.sampling.params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (verify rows in CUDA graphs)")


def workload(seed: int = 0) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    reqs = []
    for i in range(32):
        motif = [rng.randrange(3, 512) for _ in range(rng.randrange(3, 6))]
        prompt = motif * rng.randrange(2, 5) + [rng.randrange(3, 512)]
        reqs.append((f"r{i}", prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randrange(4, 48))))
    return reqs


def run(spec: str | None, graphs: bool, abort_at: int | None, **kw) -> tuple[dict, object]:
    extra = dict(speculative_algorithm=spec, speculative_adaptive=False) if spec else {}
    if spec == "draft":  # the target's own tiny config as the draft (dummy weights, same seed): it guesses right
        extra["speculative_draft_model_path"] = TINY
    eng = make_tiny_engine(TINY, device="cuda", cuda_graph=graphs, overlap_schedule=graphs, **extra, **kw)
    for rid, ids, params in workload():
        eng.add_request(rid, ids, params)
    outs = []
    if abort_at is not None:
        for _ in range(abort_at):
            outs += eng.step()
        for rid in ("r3", "r17", "r30"):
            eng.abort(rid)
    outs += drain(eng)
    return collect(outs), eng


TINY = ""


@pytest.fixture(autouse=True)
def _tiny(tiny_config_path):
    global TINY
    TINY = tiny_config_path


@pytest.mark.parametrize("algorithm", ["ngram", "block", "draft"])
@pytest.mark.parametrize("case", ["staggered", "preempt", "abort"])
def test_verify_in_cuda_graphs_equals_eager_plain_decode(case, algorithm):
    kw = dict(kv_cache_memory=120 * 2 * 2 * 4 * 2 * 16 * 4) if case == "preempt" else {}
    abort_at = 5 if case == "abort" else None
    want, _ = run(spec=None, graphs=False, abort_at=abort_at, **kw)
    got, eng = run(spec=algorithm, graphs=True, abort_at=abort_at, **kw)
    assert eng.runner.graphs is not None
    for key, w in want.items():
        if w["reason"] == "abort":  # (a run that speculates may have finished it before the abort)
            assert got[key]["reason"] == "abort" or got[key]["ids"][: len(w["ids"])] == w["ids"], key
            continue
        assert got[key]["ids"] == w["ids"], key
    st = eng.spec.stats
    assert 0 < st.accepted_tokens < st.proposed_tokens if algorithm == "ngram" else st.proposed_tokens > 0
    if algorithm == "draft":  # its decode steps replay its own graphs, and its drafts are kept
        assert eng.spec.proposer.runner.graphs is not None and st.accepted_tokens > 0
    if case == "preempt":
        assert eng.scheduler.stats.preemptions > 0
    assert_drained(eng)
