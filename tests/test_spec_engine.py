"""Speculative decoding in the engine (engine/speculation.py) on the tiny random Llama: output is
exactly what it is without speculation (greedy ids, logprobs, finish reasons) under overlap,
preemption, n > 1, stops and length limits inside a verify, penalties, aborts of requests sharing
a prefix; every page comes back and the prefix cache ends as without speculation; and sampled
tokens follow the same distribution with speculation as without (chi-square, a vocabulary of 8).

Each test runs with both proposers: `ngram`, and `draft` with the tiny model's first layer as the
draft (the same random weights, one layer of two: it agrees with the target about one token in
ten and now and then on all four, in whatever dtype the CPU defaults to; the whole tiny model in
the CPU's default dtype was the draft before, and on a CPU without native bf16 that is fp32, the
target itself: every draft kept, no rollback tested). Speculation runs with the cost model off (speculative_adaptive=False) so that
every step that can verify does; each test checks that drafts were proposed, kept and rejected,
so it cannot pass without exercising the verify it guards."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from conftest import TINY_LLAMA, assert_drained, collect, drain, make_tiny_engine
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams
from ketch.spec.cost_model import AlwaysSpeculate
from ketch.spec.ngram import NgramProposer

pytestmark = pytest.mark.usefixtures("run_engine_modes")

NGRAM = dict(speculative_algorithm="ngram", speculative_adaptive=False)
BLOCK = dict(speculative_algorithm="block", speculative_adaptive=False)  # the draft head's random weights


def one_layer_draft(tiny_config_path: str, directory, **changes) -> str:
    """The tiny model cut to its first layer (the same dummy weights), as a draft model's path."""
    path = directory / "draft.json"
    path.write_text(json.dumps({**json.load(open(tiny_config_path)), "num_hidden_layers": 1, **changes}))
    return str(path)


@pytest.fixture(params=["ngram", "draft", "block"])
def spec(request, tiny_config_path, tmp_path) -> dict:
    """The engine kwargs of one proposer."""
    if request.param == "ngram":
        return NGRAM
    if request.param == "block":
        return BLOCK
    return dict(speculative_algorithm="draft", speculative_draft_model_path=one_layer_draft(tiny_config_path, tmp_path),
                speculative_adaptive=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=2)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (a motif repeated with edits): n-gram drafts find matches from the start."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        motif = [rng.randrange(3, 512) for _ in range(rng.randrange(3, 7))]
        body = []
        for _ in range(rng.randrange(3, 6)):
            body += [t if rng.random() > 0.15 else rng.randrange(3, 512) for t in motif]
        out.append(body)
    return out


def run(config_path: str, requests: list[tuple[str, list[int], SamplingParams]], **kw) -> tuple[dict, Engine]:
    eng = make_tiny_engine(config_path, **kw)
    for rid, ids, params in requests:
        eng.add_request(rid, ids, params)
    res = collect(drain(eng))
    return res, eng


def tree_hashes(eng: Engine) -> set[bytes]:
    """The prefix cache's content: chained page hashes (pages' ids differ between runs)."""
    return {h for n in eng.cache.nodes() for h in n.hashes}


def assert_same(spec: dict, plain: dict) -> None:
    assert spec.keys() == plain.keys()
    for key in plain:
        a, b = spec[key], plain[key]
        assert a["ids"] == b["ids"], key
        assert (a["reason"], a["ends"]) == (b["reason"], b["ends"]) == (b["reason"], 1), key
        assert len(a["logprobs"]) == len(b["logprobs"])
        for x, y in zip(a["logprobs"], b["logprobs"]):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def assert_verified(eng: Engine) -> None:
    st = eng.spec.stats
    assert st.accepted_tokens > 0, "no draft was kept: the test did not exercise a verify"
    assert st.proposed_tokens > st.accepted_tokens, "no draft was rejected: rollback went untested"


def test_greedy_output_and_prefix_cache_unchanged(tiny_config_path, spec):
    reqs = [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts(6))]
    plain, eng0 = run(tiny_config_path, reqs)
    got, eng1 = run(tiny_config_path, reqs, **spec)
    assert_same(got, plain)
    assert_verified(eng1)
    assert tree_hashes(eng1) == tree_hashes(eng0)  # rollback left no rejected token in the cache
    assert eng1.stats().generated_tokens == eng0.stats().generated_tokens
    assert_drained(eng0)
    assert_drained(eng1)


def test_second_pass_hits_the_prefix_cache_and_is_unchanged(tiny_config_path, spec):
    eng = make_tiny_engine(tiny_config_path, **spec)
    reqs = [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts(4, seed=1))]
    first, second = [], []
    for out in (first, second):
        for rid, ids, params in reqs:
            eng.add_request(rid, ids, params)
        out.append(collect(drain(eng)))
    assert eng.scheduler.stats.cached_prompt_tokens > 0
    assert_same(second[0], first[0])
    assert_verified(eng)
    assert_drained(eng)


def test_preemption_and_n_samples(tiny_config_path, spec):
    """A pool of 40 pages of 4 tokens for 4 requests x 2 samples of ~60 tokens: preemption
    recomputes requests that held drafts' pages; n = 2 greedy samples are equal."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=2)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(prompts(4, seed=2))]
    small = dict(kv_cache_memory=40 * 2 * 2 * 4 * 2 * 16 * 4)  # layers * K,V * page * kv heads * dim * fp32
    plain, eng0 = run(tiny_config_path, reqs, **small)
    got, eng1 = run(tiny_config_path, reqs, **small, **spec)
    assert eng1.scheduler.stats.preemptions > 0
    assert_same(got, plain)
    for i in range(4):
        assert got[(f"r{i}", 0)]["ids"] == got[(f"r{i}", 1)]["ids"]
    assert_verified(eng1)
    assert_drained(eng0)
    assert_drained(eng1)


def test_a_draft_model_with_a_shorter_context_stops_drafting_at_its_end(tmp_path, tiny_config_path):
    """The draft's context (max_position_embeddings 48) is shorter than the target's (1024): the
    sequences grow past it, the draft proposes only inside it, and the output is the target's
    own (before: the draft decoded past its rotary table, an IndexError that ended every request)."""
    short = one_layer_draft(tiny_config_path, tmp_path, max_position_embeddings=48)
    reqs = [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts(3, seed=4))]  # 9-30 tokens, 40 more each
    plain, _ = run(tiny_config_path, reqs)
    got, eng = run(tiny_config_path, reqs, speculative_algorithm="draft", speculative_draft_model_path=short,
                   speculative_adaptive=False)
    assert_same(got, plain)
    assert_verified(eng)
    assert_drained(eng)


def test_stops_and_length_limits_inside_a_verify(tiny_config_path, spec):
    """EOS, a stop token (also under min_tokens) and max_tokens end a request at the same token
    with speculation as without, though the verify ran drafts past it."""
    base = prompts(6, seed=3)
    plain, eng0 = run(tiny_config_path, [("probe", base[0], GREEDY)])
    stop = plain[("probe", 0)]["ids"][9]  # a token the greedy output reaches
    reqs = [
        ("eos", base[0], SamplingParams(temperature=0.0, max_tokens=40)),
        ("stop", base[1], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop], ignore_eos=True)),
        ("max", base[2], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)),
        ("min", base[4], SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20, stop_token_ids=[stop])),
    ]
    kw = dict(eos_token_ids=(stop,))
    plain, eng0 = run(tiny_config_path, reqs, **kw)
    got, eng1 = run(tiny_config_path, reqs, **kw, **spec)
    assert_same(got, plain)
    assert plain[("eos", 0)]["reason"] == "stop" and plain[("max", 0)]["reason"] == "length"
    assert len(plain[("max", 0)]["ids"]) == 7 and plain[("stop", 0)]["ids"][-1] == stop
    assert_verified(eng1)
    assert_drained(eng1)


@pytest.mark.parametrize("edit", [
    dict(repetition_penalty=1.05),
    dict(frequency_penalty=0.05),  # counts: a row that missed the drafts before it counts one too few
    dict(frequency_penalty=0.02, presence_penalty=0.05),
    dict(logit_bias={7: 3.0, 9: -2.0}),
], ids=["repetition", "frequency", "frequency+presence", "logit_bias"])
def test_sampling_edits_see_the_drafts_before_each_row(tiny_config_path, spec, edit):
    """Row j of a verify must see the output plus drafts 0..j-1 (penalties count them)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, **edit)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(prompts(8, seed=4))]
    plain, _ = run(tiny_config_path, reqs)
    got, eng = run(tiny_config_path, reqs, **spec)
    assert_same(got, plain)
    assert eng.spec.stats.proposed_tokens > 0
    if spec is NGRAM or "logit_bias" not in edit:  # the draft model knows nothing of the bias: all rejected
        assert eng.spec.stats.accepted_tokens > 0
    assert_drained(eng)


def test_abort_mid_decode_while_others_share_the_prefix(tiny_config_path, spec):
    """Known failure (n-gram + radix cache + cancellation corrupted shared prefixes): requests
    sharing a long prefix, one aborted mid-decode; the others' outputs are those of a run
    without the prefix cache and without speculation."""
    shared = prompts(1, seed=5)[0] * 2
    reqs = [(f"r{i}", shared + [100 + i, 200 + i], GREEDY) for i in range(4)]
    reference, _ = run(tiny_config_path, reqs, enable_prefix_cache=False)
    eng = make_tiny_engine(tiny_config_path, **spec)
    for rid, ids, params in reqs:
        eng.add_request(rid, ids, params)
    outs = []
    for _ in range(6):
        outs += eng.step()
    eng.abort("r1")
    outs += drain(eng)
    res = collect(outs)
    for rid in ("r0", "r2", "r3"):
        assert res[(rid, 0)]["ids"] == reference[(rid, 0)]["ids"]
    assert res[("r1", 0)]["reason"] == "abort"
    assert_verified(eng)
    assert_drained(eng)



def test_a_seeded_sample_is_the_one_without_speculation(tiny_config_path, spec):
    """Same seed, same output: a sampled verify row draws the number plain decoding draws at its
    output index and keeps its draft only if that draw is the draft, so a seeded sample does not
    depend on whether a step speculated, which the cost model decides by batch size and timing
    (before: the accept test drew from a stream of its own, and speculation changed the tokens)."""
    params = SamplingParams(temperature=0.02, top_p=0.9, max_tokens=40, ignore_eos=True, seed=100, n=2,
                            logprobs=True)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(prompts(6))]
    plain, _ = run(tiny_config_path, reqs)
    got, eng = run(tiny_config_path, reqs, **spec)
    assert_same(got, plain)
    assert got[("r0", 0)]["ids"] != got[("r0", 1)]["ids"]  # sampled: seed + i draws differ
    assert_verified(eng)
    assert_drained(eng)


class ScriptedCost(AlwaysSpeculate):
    """A cost model that chooses from a fixed pattern and records, for every decode step launched,
    what it chose for it and how the step ran."""

    def __init__(self, pattern: list[bool]) -> None:
        self.pattern, self.chosen, self.ran = pattern, [], []

    def should_speculate(self, batch_size: int) -> bool:
        self.chosen.append(self.pattern[len(self.chosen) % len(self.pattern)])
        return self.chosen[-1]

    def launched(self, now: float, batch_size: int, decode_only: bool, speculating: bool) -> None:
        if decode_only:
            self.ran.append((self.chosen[-1], speculating))


def test_every_step_runs_in_the_mode_the_cost_model_chose(tiny_config_path, spec):
    """Known failure (H200, overlap): a verify step in flight made the next step propose drafts
    too, so a step the cost model chose plain speculated and speculation never turned off."""
    reqs = [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts(4))]
    plain, _ = run(tiny_config_path, reqs)
    eng = make_tiny_engine(tiny_config_path, **spec)
    eng.spec.cost = cost = ScriptedCost([True, False, False, True, True, False, True, True, True, False])
    for rid, ids, params in reqs:
        eng.add_request(rid, ids, params)
    assert_same(collect(drain(eng)), plain)
    assert [ran for _, ran in cost.ran] == [chosen for chosen, _ in cost.ran]
    assert {(True, True), (False, False)} <= set(cost.ran)  # both modes ran, both after each other
    assert eng.spec.stats.proposed_tokens > 0
    assert_drained(eng)


VOCAB8 = dict(TINY_LLAMA, vocab_size=8, eos_token_id=7, bos_token_id=6)
CHI2_DF7_P001 = 24.32  # chi-square critical values at p = 0.001 (tables): 7 degrees of freedom,
CHI2_DF1_P001 = 10.83  # and 1


def chi2(table: np.ndarray) -> float:
    """Pearson's statistic of a 2 x m contingency table (empty columns dropped)."""
    table = table[:, table.sum(0) > 0].astype(float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("algorithm", ["ngram", "draft", "block"])
def test_sampled_tokens_follow_the_same_distribution(tmp_path, algorithm):
    """1,500 seeded samples of 5 tokens at temperature 1 on a model with 8 tokens, speculation on
    vs off. The distribution may not differ: two-sample chi-square per output position, and
    (ngram) on how often a token is the one the n-gram proposer would guess from the tokens
    before it, where a biased accept rule shows first: a draft kept 1.5x too often fails it, the
    per-position test alone would not see it."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(VOCAB8))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    guess = NgramProposer(1)
    on = dict(speculative_algorithm=algorithm, speculative_adaptive=False)
    if algorithm == "draft":
        on["speculative_draft_model_path"] = str(path)
    counts, guessed = [], []
    for kw in ({}, on):
        eng = make_tiny_engine(str(path), **kw)
        for i in range(1500):
            eng.add_request(f"s{i}", prompt, SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=i))
        res = collect(drain(eng))
        toks = np.array([res[(f"s{i}", 0)]["ids"] for i in range(1500)])
        counts.append(np.stack([np.bincount(toks[:, j], minlength=8) for j in range(5)]))
        hits = [guess.lookup(np.array(prompt + list(t[:j])), 1) == [t[j]] for t in toks for j in range(1, 5)]
        guessed.append([sum(hits), len(hits) - sum(hits)])
        if kw:
            assert_verified(eng)
        assert_drained(eng)
    for j in range(1, 5):  # position 0 is the prefill's token: no draft before it
        assert chi2(np.stack([counts[0][j], counts[1][j]])) < CHI2_DF7_P001, (j, counts[0][j], counts[1][j])
    if algorithm == "ngram":
        assert chi2(np.array(guessed)) < CHI2_DF1_P001, guessed
