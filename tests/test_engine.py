"""Engine behaviour on a tiny random model: aborts in every state, preemption, n > 1,
bad input, and the page invariant after every scenario; each with overlap scheduling off and on."""
from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import assert_drained, collect, drain, make_tiny_engine
from ketch.sampling.params import SamplingParams
from ketch.scheduler.request import RequestState

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("run_engine_modes")  # every test with overlap scheduling off and on


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def test_runs_to_length_and_drains(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path)
    for i in range(5):
        eng.add_request(f"r{i}", prompt(10 + i, i), GREEDY)
    res = collect(drain(eng))
    assert len(res) == 5
    for r in res.values():
        assert len(r["ids"]) == 8 and r["reason"] == "length" and r["ends"] == 1
    assert_drained(eng)


def _state_of(eng, rid):
    return eng.requests[rid][0].state


def test_abort_waiting(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path, max_num_seqs=1)
    eng.add_request("a", prompt(8), GREEDY)
    eng.add_request("b", prompt(8, 1), GREEDY)
    eng.step()
    assert _state_of(eng, "b") is RequestState.WAITING
    eng.abort("b")
    res = collect(drain(eng))
    assert res[("b", 0)] == {"ids": [], "reason": "abort", "logprobs": [], "ends": 1}
    assert res[("a", 0)]["reason"] == "length"
    assert_drained(eng)


def test_abort_prefilling(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path, chunked_prefill_size=4)
    eng.add_request("a", prompt(30), GREEDY)
    eng.step()
    req = eng.requests["a"][0]
    assert req.state is RequestState.RUNNING and 0 < req.num_computed < len(req.prompt_ids)
    eng.abort("a")
    res = collect(drain(eng))
    assert res[("a", 0)]["reason"] == "abort" and res[("a", 0)]["ends"] == 1
    assert_drained(eng)


def test_abort_decoding_and_after_finish(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path)
    eng.add_request("a", prompt(8), GREEDY)
    outs = []
    while sum(len(o.new_token_ids) for o in outs) < 3:  # overlap: a step's tokens come one call late
        outs += eng.step()
    assert sum(len(o.new_token_ids) for o in outs) == 3
    assert eng._in_flight is not None or not eng.overlap  # overlap: a 4th token is being computed
    eng.abort("a")
    eng.abort("a")  # twice: still one end
    eng.abort("never-existed")
    res = collect(outs + drain(eng))
    assert res[("a", 0)]["reason"] == "abort" and res[("a", 0)]["ends"] == 1 and len(res[("a", 0)]["ids"]) == 3
    assert_drained(eng)


def test_preemption_recomputes_and_aborting_preempted(tiny_config_path):
    # 12 pages of 4 tokens; each request needs up to 10 pages, so 6 at once must preempt
    eng = make_tiny_engine(tiny_config_path, kv_cache_memory=12 * 2048)
    assert eng.allocator.num_pages == 12
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in range(6):
        eng.add_request(f"r{i}", prompt(16, i), params)
    outs, preempted = [], None
    for _ in range(1000):
        if not eng.has_unfinished():
            break
        outs += eng.step()
        eng.check_invariants()
        waiting = [r for r in eng.scheduler.waiting if r.num_preemptions and r.rid != "r0"]
        if preempted is None and waiting:
            preempted = waiting[0].group_id
            eng.abort(preempted)
    assert eng.scheduler.stats.preemptions > 0 and preempted is not None
    res = collect(outs)
    for (rid, _), r in res.items():
        assert r["ends"] == 1
        if rid == preempted:
            assert r["reason"] == "abort"
        else:
            assert r["reason"] == "length" and len(r["ids"]) == 24
    assert_drained(eng)


def test_n_samples_share_prompt_pages(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    eng.add_request("g", prompt(21), params)
    outs = drain(eng)
    res = collect(outs)
    assert sorted(res) == [("g", 0), ("g", 1), ("g", 2)]
    cached = {o.index: o.num_cached_tokens for o in outs if o.finished}
    assert cached[0] == 0 and cached[1] == 20 and cached[2] == 20  # every full page of the prompt
    assert_drained(eng)


def test_seeded_n_samples_reproduce(tiny_config_path):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    runs = []
    for mates in (0, 3):
        eng = make_tiny_engine(tiny_config_path)
        for i in range(mates):
            eng.add_request(f"mate{i}", prompt(9, 100 + i), SamplingParams(temperature=1.0, max_tokens=10))
        eng.add_request("s", prompt(12), params)
        res = collect(drain(eng))
        runs.append((res[("s", 0)]["ids"], res[("s", 1)]["ids"]))
        assert_drained(eng)
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]  # the n samples use different streams


def test_stop_token_ids_min_tokens_and_eos(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path)
    eng.add_request("free", prompt(8), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    first = collect(drain(eng))[("free", 0)]["ids"]
    stop_tok = first[2]
    eng.add_request("stop", prompt(8), SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_tok]))
    res = collect(drain(eng))[("stop", 0)]
    assert res["reason"] == "stop" and res["ids"][-1] == stop_tok and len(res["ids"]) == first.index(stop_tok) + 1
    assert_drained(eng)


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n"),
    ],
)
def test_bad_sampling_params_name_the_field(params, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**params).validate(512)


def test_bad_requests_leave_the_engine_serving(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path, max_model_len=64)
    for empty in ([], np.array([], dtype=np.int64)):  # (an array has no truth value to test)
        with pytest.raises(ValueError, match="^prompt: must not be empty"):
            eng.add_request("e", empty, GREEDY)
    with pytest.raises(ValueError, match="^prompt"):
        eng.add_request("e", [1, 99999], GREEDY)
    for not_ids in (None, "hello", 7):  # a ValueError naming the field, not a TypeError from len()
        with pytest.raises(ValueError, match="^prompt: must be a sequence of token ids"):
            eng.add_request("e", not_ids, GREEDY)
    with pytest.raises(ValueError, match="^params: must be a SamplingParams"):
        eng.add_request("e", prompt(8), None)
    for bad in ([1.7, 2.9], [True, 2], ["a"], [None]):  # not truncated, not a TypeError from inside min()
        with pytest.raises(ValueError, match="^prompt: token ids must be integers"):
            eng.add_request("e", bad, GREEDY)
    with pytest.raises(ValueError, match="^max_tokens.*60.*10.*64"):
        eng.add_request("e", prompt(60), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="^logit_bias"):
        eng.add_request("e", prompt(8), SamplingParams(logit_bias={100000: 1.0}))
    eng.add_request("ok", prompt(8), GREEDY)
    with pytest.raises(ValueError, match="^request_id"):
        eng.add_request("ok", prompt(8), GREEDY)
    eng.add_request("array", np.array(prompt(8)), GREEDY)  # ids as a numpy array: served as the list is
    res = collect(drain(eng))
    assert sorted(res) == [("array", 0), ("ok", 0)] and len(res[("ok", 0)]["ids"]) == 8
    assert res[("array", 0)]["ids"] == res[("ok", 0)]["ids"]
    assert_drained(eng)


def test_prefix_cache_hit_rate_on_shared_system_prompt(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path, kv_cache_memory=8 * 1024 * 1024)
    system = prompt(200, 42)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.add_request("first", system + prompt(10, 0), params)
    drain(eng)
    for i in range(1, 9):
        eng.add_request(f"u{i}", system + prompt(10, i), params)
    drain(eng)
    stats = eng.scheduler.stats
    saved = stats.cached_prompt_tokens
    print(f"prefix cache: hit rate {stats.cache_hit_rate:.1%}, prefill tokens saved {saved} of {stats.prompt_tokens}")
    assert saved == 8 * 200  # every full page of the shared 200-token system prompt (page size 4)
    assert stats.cache_hit_rate == pytest.approx(1600 / (9 * 210))
    assert_drained(eng)


def test_a_leaked_reference_on_a_cached_page_is_seen(tiny_config_path):
    """A reference nobody owns on a cached page (what an abort that forgot a decref leaves)
    keeps the page counts right: the page still looks cached and evictable. The shadow count
    and the stats' unaccounted references see it."""
    eng = make_tiny_engine(tiny_config_path)
    eng.add_request("a", prompt(20), GREEDY)
    drain(eng)
    page = min(eng.cache.cached_page_set())
    eng.allocator.incref([page])
    s = eng.stats()
    assert s.kv_pages_free + s.kv_pages_evictable == s.kv_pages_total and s.kv_pages_in_use == 0
    assert s.kv_page_refs_unaccounted == 1
    with pytest.raises(AssertionError, match=f"page {page}: refcount 2"):
        eng.check_invariants()
    eng.allocator.decref([page])
    assert_drained(eng)


def test_disabled_prefix_cache_keeps_nothing(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path, enable_prefix_cache=False)
    eng.add_request("a", prompt(40), GREEDY)
    eng.add_request("b", prompt(40), GREEDY)
    drain(eng)
    assert eng.scheduler.stats.cached_prompt_tokens == 0
    assert eng.allocator.num_free == eng.allocator.num_pages


@pytest.mark.parametrize("policy, expected_order", [("fcfs", ["cold", "warm"]), ("lpm", ["warm", "cold"])])
def test_schedule_policy_order(tiny_config_path, policy, expected_order):
    eng = make_tiny_engine(tiny_config_path, max_num_seqs=1, schedule_policy=policy)
    shared = prompt(40, 9)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    eng.add_request("seed", shared + [7], params)
    drain(eng)  # the shared prefix is now cached
    eng.add_request("blocker", prompt(8, 3), params)
    eng.step()  # blocker runs; the next two wait behind it
    eng.add_request("cold", prompt(41, 4), params)
    eng.add_request("warm", shared + [8], params)
    finished = [o.request_id for o in drain(eng) if o.finished]
    assert finished[1:] == expected_order
    assert_drained(eng)


def test_burst_with_one_system_prompt_prefills_it_once(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path, kv_cache_memory=8 * 1024 * 1024, max_num_batched_tokens=1024)
    system = prompt(120, 5)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i in range(6):  # all arrive together; the budget could admit them in one step
        eng.add_request(f"u{i}", system + prompt(9, 50 + i), params)
    outs = drain(eng)
    cached = sorted(o.num_cached_tokens for o in outs if o.finished)
    assert cached == [0] + [120] * 5  # the first computes the system prompt, the rest wait and hit it
    assert eng.scheduler.stats.computed_tokens == 129 + 5 * 9 + 6 * 2  # prompts once, then decode
    assert_drained(eng)


def test_requests_differing_before_the_page_do_not_wait(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path, chunked_prefill_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    x, y, p = prompt(8, 1), prompt(8, 2), prompt(4, 3)  # two pages of 4, then one more page
    eng.add_request("seed", x + [9], params)
    drain(eng)  # x is cached
    eng.add_request("other", y + p + prompt(30, 4), params)  # prefills for several steps
    eng.step()
    eng.add_request("req", x + p + prompt(6, 5), params)  # page p sits at the same offset, after x
    eng.step()
    assert eng.requests["other"][0].num_computed < len(eng.requests["other"][0].prompt_ids)
    assert eng.requests["req"][0].state is RequestState.RUNNING  # other's p-page is not our prefix
    drain(eng)
    assert_drained(eng)
