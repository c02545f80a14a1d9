"""Resuming a stream (issue 16): a request that brings the first k output ids of an earlier run
(`generated_token_ids`) continues it exactly — greedy and seeded sampling, penalties, min_tokens,
stop tokens, max_tokens, chunked prefill, prefix-cache hits — with overlap scheduling off and on.
Text (stop strings across the boundary, the joined stream) is in test_resume_text.py and, through
the server, test_server_resume.py."""
from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from conftest import assert_drained, collect, drain, make_tiny_engine
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams

pytestmark = pytest.mark.usefixtures("run_engine_modes")  # every test with overlap scheduling off and on

EOS = 2  # TINY_LLAMA's
_ids = itertools.count()


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def run(eng: Engine, ids: list[int], params: SamplingParams, generated: Sequence[int] = ()) -> dict:
    """One request to its end: the ids this engine reported, its finish reason, its outputs."""
    rid = f"q{next(_ids)}"
    eng.add_request(rid, ids, params, generated)
    outs = [o for o in drain(eng) if o.request_id == rid]
    res = collect(outs)[(rid, 0)]
    return {**res, "outs": outs}


def assert_resumes(eng: Engine, ids: list[int], params: SamplingParams, splits: Sequence[int]) -> list[int]:
    """The whole run, then for each k: resumed with its first k ids, the rest is the same."""
    whole = run(eng, ids, params)
    assert whole["ends"] == 1
    for k in splits:
        assert 0 < k < len(whole["ids"]), (k, whole["ids"])
        rest = run(eng, ids, params, whole["ids"][:k])
        assert rest["ids"] == whole["ids"][k:], f"resumed at {k}"
        assert rest["reason"] == whole["reason"] and rest["ends"] == 1
    assert_drained(eng)
    return whole["ids"]


def test_greedy_resumes_exactly(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = assert_resumes(eng, prompt(9), params, [1, 4, 11])
    assert len(set(ids)) > 1  # a run that repeats one token would hide a shifted continuation


def test_seeded_sampling_resumes_exactly(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=200, seed=11, max_tokens=14, ignore_eos=True)
    ids = assert_resumes(eng, prompt(7, 1), params, [1, 6, 13])
    assert len(set(ids)) > 4  # sampling at temperature 1 over a random model: varied tokens


def test_sample_i_of_n_resumes_with_seed_plus_i(tiny_config_path):
    """How the gateway resumes one choice of an n > 1 request: n = 1 and seed + index."""
    eng = make_tiny_engine(tiny_config_path)
    ids = prompt(6, 2)
    eng.add_request("n3", ids, SamplingParams(n=3, temperature=1.0, seed=40, max_tokens=10, ignore_eos=True))
    res = collect(drain(eng))
    samples = [res[("n3", i)]["ids"] for i in range(3)]
    assert len({tuple(s) for s in samples}) == 3, "the n samples must differ"
    rest = run(eng, ids, SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True), samples[2][:4])
    assert rest["ids"] == samples[2][4:]
    assert_drained(eng)


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 1.5}, {"presence_penalty": 1.5},
                                     {"repetition_penalty": 1.8}], ids=lambda p: next(iter(p)))
def test_penalties_count_the_resumed_tokens(tiny_config_path, penalty):
    """Three tokens biased far above the rest: unpenalized, greedy repeats the first forever;
    penalized, which one comes next depends on how often each came before, the resumed ones too."""
    eng = make_tiny_engine(tiny_config_path)
    base = dict(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={100: 10.0, 101: 9.0, 102: 8.0})
    ids = prompt(5, 3)
    assert run(eng, ids, SamplingParams(**base))["ids"] == [100] * 16
    penalized = assert_resumes(eng, ids, SamplingParams(**base, **penalty), [3, 8])
    assert len(set(penalized)) > 1


def test_min_tokens_counts_the_resumed_tokens(tiny_config_path):
    """EOS is forced (a +100 bias) but banned until min_tokens are out: the run is exactly
    min_tokens tokens and EOS, and so is a resumed one, whose resumed tokens count towards them."""
    eng = make_tiny_engine(tiny_config_path, eos_token_ids=(EOS,))
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=7, logit_bias={EOS: 100.0})
    ids = assert_resumes(eng, prompt(6, 4), params, [2, 6, 7])
    assert len(ids) == 8 and ids[-1] == EOS and EOS not in ids[:-1]


def test_a_stop_token_right_after_the_boundary(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path)
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = prompt(8, 5)
    whole = run(eng, ids, base)["ids"]
    stop = whole[5]  # the stop token is the first one the resumed run makes
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    first = whole.index(stop)
    rest = run(eng, ids, params, whole[:first])
    assert rest["ids"] == [stop] and rest["reason"] == "stop"
    assert_drained(eng)


def test_max_tokens_is_the_whole_output(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ids = prompt(8, 6)
    whole = run(eng, ids, params)["ids"]
    rest = run(eng, ids, params, whole[:9])
    assert rest["ids"] == whole[9:] and len(rest["ids"]) == 1 and rest["reason"] == "length"
    stats = eng.stats()
    assert stats.generated_tokens == 10 + 1  # the resumed tokens were not generated here
    assert_drained(eng)


def test_outputs_report_the_original_prompt(tiny_config_path):
    """Usage's inputs: num_prompt_tokens is the prompt's, and num_cached_tokens (a prefix-cache
    hit that may reach into the resumed ids) never exceeds it."""
    eng = make_tiny_engine(tiny_config_path)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = prompt(10, 7)
    whole = run(eng, ids, params)  # puts prompt + output in the prefix cache
    rest = run(eng, ids, params, whole["ids"][:8])
    assert all(o.num_prompt_tokens == 10 for o in rest["outs"])
    # the hit is 4 pages of 4 = 16 tokens (prompt + resumed ids but the last): the prompt's 10 are cached
    assert rest["outs"][0].num_cached_tokens == 10
    assert eng.scheduler.stats.cached_prompt_tokens <= eng.scheduler.stats.prompt_tokens
    assert sum(len(o.new_token_ids) for o in rest["outs"]) == 4
    assert_drained(eng)


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
def test_resumed_with_chunked_prefill_and_cache_hits(tiny_config_path, prefix_cache):
    """The resumed ids are prefilled in chunks (boundaries inside them), after a prompt the prefix
    cache serves or not; nothing changes the continuation."""
    eng = make_tiny_engine(tiny_config_path, chunked_prefill_size=3, enable_prefix_cache=prefix_cache)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=15, ignore_eos=True, presence_penalty=0.5)
    ids = prompt(11, 8)
    whole = run(eng, ids, params)["ids"]
    rest = run(eng, ids, params, whole[:10])
    assert rest["ids"] == whole[10:]
    hit = rest["outs"][0].num_cached_tokens
    assert (hit > 0) == prefix_cache
    fresh = make_tiny_engine(tiny_config_path, chunked_prefill_size=3, enable_prefix_cache=prefix_cache)
    assert run(fresh, ids, params, whole[:10])["ids"] == whole[10:]  # another worker, nothing cached
    assert_drained(eng)
    assert_drained(fresh)


@pytest.mark.parametrize("kwargs, generated, match", [
    ({"n": 2, "seed": 1}, [5], "generated_token_ids: a stream is resumed one sample at a time"),
    ({}, [5, 512], r"generated_token_ids: token ids must be in \[0, 512\)"),
    ({}, [-1], r"generated_token_ids: token ids must be in \[0, 512\)"),
    ({"max_tokens": 3}, [5, 6, 7], "generated_token_ids: 3 tokens were generated already"),
    ({}, [5, EOS, 6], r"generated_token_ids: token 1 \(2\) is a stop token"),
    ({"stop_token_ids": [9]}, [9], r"generated_token_ids: token 0 \(9\) is a stop token"),
])
def test_bad_resume_names_the_field(tiny_config_path, kwargs, generated, match):
    eng = make_tiny_engine(tiny_config_path, eos_token_ids=(EOS,))
    with pytest.raises(ValueError, match=match):
        eng.add_request("bad", prompt(5), SamplingParams(**{"max_tokens": 8, **kwargs}), generated)
    assert not eng.requests and not eng.has_unfinished()  # the engine is unchanged


def test_stop_tokens_the_original_could_pass(tiny_config_path):
    """EOS inside the resumed ids is fine where the original could not have stopped on it
    (ignore_eos, or before min_tokens)."""
    eng = make_tiny_engine(tiny_config_path, eos_token_ids=(EOS,))
    for params in (SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0),
                   SamplingParams(max_tokens=8, min_tokens=3, temperature=0.0)):
        rest = run(eng, prompt(5), params, [5, EOS])
        assert rest["ends"] == 1 and len(rest["ids"]) >= 1
    assert_drained(eng)
