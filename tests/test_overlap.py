"""Overlap scheduling (engine.py): step N+1 is scheduled and launched before step N's tokens
reach the host. Whatever the order, the outputs must be those of the plain loop: same ids,
same finish reasons, every page back. The engine-behaviour tests (test_engine.py) also run in
both modes; these target what only overlap can get wrong: a request that stopped while its
next row was in flight, the length limit, placeholders in prefix-cache pages, samplers that
read the generated ids, aborts of in-flight rows.
"""
from __future__ import annotations

import random
import time

import pytest

from conftest import assert_drained, collect, drain, make_tiny_engine
from ketch.runner.future_tokens import is_placeholder
from ketch.sampling.params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def run(config_path: str, overlap: bool, requests: list[tuple[str, list[int], SamplingParams]], **kw):
    eng = make_tiny_engine(config_path, overlap_schedule=overlap, **kw)
    assert eng.overlap is overlap
    for rid, ids, params in requests:
        eng.add_request(rid, ids, params)
    res = collect(drain(eng))
    assert_drained(eng)
    return res, eng


def ids_and_reasons(res: dict) -> dict:
    return {k: (v["ids"], v["reason"], v["ends"]) for k, v in res.items()}


def test_mixed_workload_is_identical_with_and_without_overlap(tiny_config_path):
    """Chunked prefill, preemption (a small pool), prefix hits, n = 2, stops, lengths, logprobs."""
    shared = prompt(24, 99)
    reqs = []
    for i in range(10):
        ids = (shared if i % 3 == 0 else []) + prompt(5 + 6 * i, i)
        params = SamplingParams(max_tokens=4 + 3 * i, n=2 if i == 4 else 1, logprobs=i % 2 == 0, **GREEDY)
        reqs.append((f"r{i}", ids, params))
    kw = dict(kv_cache_memory=40 * 2048, max_num_seqs=4, chunked_prefill_size=8, max_num_batched_tokens=16)
    sync, e_sync = run(tiny_config_path, False, reqs, **kw)
    over, e_over = run(tiny_config_path, True, reqs, **kw)
    assert ids_and_reasons(over) == ids_and_reasons(sync)
    assert e_sync.scheduler.stats.preemptions > 0  # the pool was small enough to preempt
    for key, r in sync.items():
        for a, b in zip(r["logprobs"], over[key]["logprobs"], strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5


def test_no_row_runs_past_the_length_limit(tiny_config_path):
    """That a request's newest token is its last is known without the token: an overlapped
    scheduler does not run it again, so exactly the same tokens go through the model."""
    reqs = [(f"r{i}", prompt(5 + 4 * i, i), SamplingParams(max_tokens=2 + 5 * i, **GREEDY)) for i in range(5)]
    sync, e_sync = run(tiny_config_path, False, reqs)
    over, e_over = run(tiny_config_path, True, reqs)
    assert ids_and_reasons(over) == ids_and_reasons(sync)
    assert e_over.scheduler.stats.computed_tokens == e_sync.scheduler.stats.computed_tokens


def _reference(tiny_config_path, ids: list[int], max_tokens: int) -> list[int]:
    res, _ = run(tiny_config_path, False, [("ref", ids, SamplingParams(max_tokens=max_tokens, **GREEDY))])
    return res[("ref", 0)]["ids"]


def test_a_stop_token_drops_the_row_already_in_flight(tiny_config_path):
    ids = prompt(11, 5)
    ref = _reference(tiny_config_path, ids, 12)
    stop = ref[4]
    assert stop not in ref[:4], "pick a prompt whose 5th token is new"
    params = SamplingParams(max_tokens=12, stop_token_ids=[stop], **GREEDY)
    sync, e_sync = run(tiny_config_path, False, [("a", ids, params)])
    over, e_over = run(tiny_config_path, True, [("a", ids, params)])
    assert sync[("a", 0)] == over[("a", 0)]
    assert over[("a", 0)]["ids"] == ref[:5] and over[("a", 0)]["reason"] == "stop"
    assert e_over.stats().generated_tokens == e_sync.stats().generated_tokens == 5
    # the scheduler ran one more row (it could not know about the stop yet); its token was dropped
    assert e_over.scheduler.stats.computed_tokens == e_sync.scheduler.stats.computed_tokens + 1
    # and the prefix cache holds the same pages either way (the extra row's K/V is not published)
    assert e_over.cache.cached_pages == e_sync.cache.cached_pages


def test_prefix_cache_never_publishes_a_placeholder(tiny_config_path):
    """Pages fill up with generated tokens while their ids are still in flight."""
    eng = make_tiny_engine(tiny_config_path, overlap_schedule=True, page_size=2)
    eng.add_request("a", prompt(5, 3), SamplingParams(max_tokens=20, **GREEDY))
    seen_placeholder = False
    while eng.has_unfinished():
        eng.step()
        req = eng.requests.get("a", [None])[0]
        if req is not None:
            seen_placeholder |= any(is_placeholder(t) for t in req.output_ids)
        for node_ids in _cached_sequences(eng.cache):
            assert not any(is_placeholder(t) for t in node_ids)
    assert seen_placeholder  # the test did look at in-flight states
    assert_drained(eng)


def _cached_sequences(cache) -> list[list[int]]:
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        out.append(list(node.key))
        stack.extend(node.children.values())
    return out


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.5),
    dict(frequency_penalty=1.0, presence_penalty=0.5),
], ids=["repetition", "frequency+presence"])
def test_penalties_see_the_real_ids(tiny_config_path, params):
    """Penalties read the generated ids: such a step waits for the one in flight first."""
    reqs = [(f"r{i}", prompt(6 + i, i), SamplingParams(max_tokens=16, **GREEDY, **params)) for i in range(3)]
    reqs.append(("plain", prompt(9, 50), SamplingParams(max_tokens=16, **GREEDY)))
    sync, _ = run(tiny_config_path, False, reqs)
    over, _ = run(tiny_config_path, True, reqs)
    assert ids_and_reasons(over) == ids_and_reasons(sync)
    unpenalized, _ = run(tiny_config_path, False, [(f"r{i}", prompt(6 + i, i), SamplingParams(max_tokens=16, **GREEDY))
                                                   for i in range(3)])
    assert any(sync[(f"r{i}", 0)]["ids"] != unpenalized[(f"r{i}", 0)]["ids"] for i in range(3))  # penalties acted


def test_seeded_sampling_is_identical(tiny_config_path):
    reqs = [(f"r{i}", prompt(7, i), SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12))
            for i in range(4)]
    sync, _ = run(tiny_config_path, False, reqs)
    over, _ = run(tiny_config_path, True, reqs)
    assert ids_and_reasons(over) == ids_and_reasons(sync)


def test_abort_with_a_row_in_flight(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path, overlap_schedule=True)
    eng.add_request("a", prompt(8, 1), SamplingParams(max_tokens=30, **GREEDY))
    eng.add_request("b", prompt(9, 2), SamplingParams(max_tokens=6, **GREEDY))
    outs = []
    while sum(len(o.new_token_ids) for o in outs if o.request_id == "a") < 2:
        outs += eng.step()
    assert eng._in_flight is not None and any(req.rid == "a" for req, _, _ in eng._in_flight.rows)
    eng.abort("a")
    res = collect(outs + drain(eng))
    assert res[("a", 0)]["reason"] == "abort" and res[("a", 0)]["ends"] == 1 and len(res[("a", 0)]["ids"]) == 2
    assert res[("b", 0)]["reason"] == "length" and len(res[("b", 0)]["ids"]) == 6
    assert_drained(eng)


def test_tokens_arrive_one_step_late(tiny_config_path):
    """The order itself: with overlap a step returns the previous step's tokens."""
    got = {}
    for overlap in (False, True):
        eng = make_tiny_engine(tiny_config_path, overlap_schedule=overlap)
        eng.add_request("a", prompt(8, 4), SamplingParams(max_tokens=3, **GREEDY))
        got[overlap] = [sum(len(o.new_token_ids) for o in eng.step()) for _ in range(4)]
        assert not eng.has_unfinished()
    assert got[False] == [1, 1, 1, 0]  # prefill samples the first token
    assert got[True] == [0, 1, 1, 1]


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_side_tpot_counts_each_finished_requests_token_intervals_once(tiny_config_path, overlap):
    """The decode clock behind /metrics' engine-side TPOT: each finished sample adds its
    output length - 1 intervals (the overlapped row a stop token dropped is not one of them,
    a one-token sample adds none), and the time between its first and last token, which lies
    inside the run (three samples with two or more tokens: at most three runs' worth)."""
    ids = prompt(11, 5)
    stop = _reference(tiny_config_path, ids, 12)[4]
    reqs = [("stopped", ids, SamplingParams(max_tokens=12, stop_token_ids=[stop], **GREEDY)),
            ("one", prompt(7, 8), SamplingParams(max_tokens=1, **GREEDY)),
            ("pair", prompt(9, 9), SamplingParams(max_tokens=6, n=2, **GREEDY))]
    t0 = time.perf_counter()
    res, eng = run(tiny_config_path, overlap, reqs)
    wall = time.perf_counter() - t0
    s = eng.stats()
    assert [len(res[k]["ids"]) for k in [("stopped", 0), ("one", 0), ("pair", 0), ("pair", 1)]] == [5, 1, 6, 6]
    assert s.decode_intervals == 4 + 0 + 5 + 5
    assert 0 < s.decode_seconds < 3 * wall
    # the per-request histogram: one entry per sample with an interval, each its own mean interval
    assert sum(s.request_tpot_counts) == 3
    assert 0 < s.request_tpot_sum <= s.decode_seconds
