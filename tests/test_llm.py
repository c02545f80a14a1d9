"""The offline API (`ketch.LLM`) end to end on the bundled SmolLM2 GGUF in fp32.

generate / chat / stream, n > 1 and seeds, logprobs, penalties and logit_bias, min_tokens /
ignore_eos, bad input (the LLM keeps serving and its pages come back), and streaming of multi-byte
characters (stop strings and stop token ids: test_llm_stop.py). Greedy everywhere except where sampling
itself is under test (then seeded), so every assertion is deterministic.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from conftest import assert_drained
from ketch import LLM, SamplingParams
from ketch.engine.outputs import TokenLogprob

P_FRANCE = "The capital of France is"
P_STORY = "Once upon a time"
P_CODE = "def fibonacci(n):"
P_YES = "yes, yes, yes, yes, yes, yes,"
SHORT_ANSWER = [{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}]
MATH = [{"role": "user", "content": "What is 2+2? Answer with one number."}]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


@pytest.fixture(scope="module")
def llm(smollm_path) -> LLM:
    # One torch thread: on a small shared CPU box, two OpenMP threads fighting other processes for
    # the cores make every decode step ~30x slower. Restored afterwards for the other modules.
    threads = torch.get_num_threads()
    yield LLM(smollm_path, dtype="float32", num_threads=1)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.tokenizer


def _serves(llm: LLM) -> None:
    """The LLM still answers a normal request, and everything it held is back."""
    assert_drained(llm.engine)
    out = llm.generate(P_FRANCE, greedy(max_tokens=2))
    assert len(out) == 1 and len(out[0].token_ids) == 2 and out[0].finish_reason == "length"
    assert_drained(llm.engine)


# ---------------------------------------------------------------- generate / chat / stream
def test_generate_string_list_and_token_ids(llm, tok):
    params = greedy(max_tokens=8)
    [france] = llm.generate(P_FRANCE, params)
    assert france.prompt_token_ids == tok.encode(P_FRANCE)
    assert france.finish_reason == "length" and len(france.token_ids) == 8
    assert france.outputs[0].matched_stop is None and france.logprobs is None
    assert france.text == tok.decode(france.token_ids) and "Paris" in france.text
    [story] = llm.generate(P_STORY, params)

    both = llm.generate([P_FRANCE, P_STORY], params)  # one batch: same greedy ids as alone
    assert [o.token_ids for o in both] == [france.token_ids, story.token_ids]
    assert [o.text for o in both] == [tok.decode(o.token_ids) for o in both]
    assert [o.prompt_token_ids for o in both] == [tok.encode(P_FRANCE), tok.encode(P_STORY)]
    assert len({o.request_id for o in both}) == 2

    [by_ids] = llm.generate(tok.encode(P_FRANCE), params)  # one token-id prompt
    assert by_ids.token_ids == france.token_ids and by_ids.text == france.text
    by_id_lists = llm.generate([tok.encode(P_FRANCE), tok.encode(P_STORY)], params)
    assert [o.token_ids for o in by_id_lists] == [france.token_ids, story.token_ids]
    assert llm.generate([], params) == []
    assert_drained(llm.engine)


def test_eos_ends_with_stop(llm, tok):
    [out] = llm.chat(SHORT_ANSWER, greedy(max_tokens=16))
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < 16 and out.token_ids[-1] in llm.engine.eos_ids
    assert out.outputs[0].matched_stop == out.token_ids[-1]
    assert out.text == tok.decode(out.token_ids) and "<|im_end|>" not in out.text and out.text.strip()
    assert_drained(llm.engine)


def test_chat_applies_the_template(llm, tok):
    params = greedy(max_tokens=16)
    [out] = llm.chat(MATH, params)
    ids = llm.encode_chat(MATH)
    assert out.prompt_token_ids == ids
    rendered = tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\nWhat is 2+2? Answer with one number.<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    assert rendered.count("<|im_start|>system") == 1  # SmolLM2's template adds its default one
    assert out.finish_reason == "stop" and "4" in out.text
    assert llm.generate(ids, params)[0].token_ids == out.token_ids  # chat == generate on the ids

    with_system = [{"role": "system", "content": "You are a pirate."}] + MATH
    sys_ids = llm.encode_chat(with_system)
    sys_rendered = tok.decode(sys_ids, skip_special_tokens=False)
    assert sys_rendered.startswith("<|im_start|>system\nYou are a pirate.<|im_end|>\n")
    assert sys_rendered.count("<|im_start|>system") == 1 and "SmolLM" not in sys_rendered
    assert sys_rendered.endswith("<|im_start|>assistant\n")

    both = llm.chat([MATH, with_system], params)  # a list of conversations
    assert [o.prompt_token_ids for o in both] == [ids, sys_ids]
    assert both[0].token_ids == out.token_ids and both[1].token_ids
    assert_drained(llm.engine)


def test_stream_concatenates_to_generate(llm):
    params = greedy(max_tokens=12)
    deltas = list(llm.stream(P_STORY, params))
    [out] = llm.generate(P_STORY, params)
    assert len(deltas) > 1  # really incremental
    assert "".join(deltas) == out.text
    assert_drained(llm.engine)


def test_stream_closed_early_releases_the_request(llm):
    gen = llm.stream(P_STORY, greedy(max_tokens=50))
    assert next(gen)
    gen.close()
    assert not llm.engine.requests
    _serves(llm)


def test_a_stream_dropped_or_closed_unread_releases_its_request(llm):
    """A stream never iterated has a generator that never started, whose `finally` never runs:
    dropped, its request is aborted at the LLM's next step instead of decoding inside every later
    call; closed unread, at once. Either way the later output is its own and every page comes back."""
    params = greedy(max_tokens=40, ignore_eos=True)
    [alone] = llm.generate(P_FRANCE, greedy(max_tokens=4))
    dropped = llm.stream(P_STORY, params)
    del dropped  # no cycle holds it: finalized here
    assert llm.generate(P_FRANCE, greedy(max_tokens=4))[0].token_ids == alone.token_ids
    assert not llm.engine.requests and not llm._inbox
    assert_drained(llm.engine)
    closed = llm.stream(P_STORY, params)
    closed.close()
    assert not llm.engine.requests and not llm._inbox
    assert_drained(llm.engine)


def test_open_streams_and_generate_calls_interleave(llm):
    """A stream left open while generate() runs, and two streams read in turn, each get their own
    text whole (each step's outputs go to the request they belong to, whoever steps the engine;
    they were swallowed by the other loop, and the stream then spun forever)."""
    params = greedy(max_tokens=10)
    [france], [story] = llm.generate(P_FRANCE, params), llm.generate(P_STORY, params)
    stream = llm.stream(P_FRANCE, params)
    got = [next(stream)]
    assert [o.text for o in llm.generate([P_STORY, P_CODE], params)][0] == story.text
    assert "".join(got + list(stream)) == france.text
    a, b = llm.stream(P_FRANCE, params), llm.stream(P_STORY, params)
    texts = ["", ""]
    for da, db in itertools.zip_longest(a, b, fillvalue=""):
        texts[0] += da
        texts[1] += db
    assert texts == [france.text, story.text]
    assert_drained(llm.engine)


# ---------------------------------------------------------------- n > 1, seeds, top_k
def test_n_samples_are_seeded_and_reproducible(llm, tok):
    params = SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=8)
    first = llm.generate(P_STORY, params)
    second = llm.generate(P_STORY, params)
    assert len(first) == 1 and len(first[0].outputs) == 3
    samples = first[0].outputs
    assert [c.index for c in samples] == [0, 1, 2]
    for c in samples:
        assert c.finish_reason in ("stop", "length") and 0 < len(c.token_ids) <= 8
        assert c.text == tok.decode(c.token_ids)
    assert first[0].text == samples[0].text and first[0].token_ids == samples[0].token_ids
    assert [c.token_ids for c in second[0].outputs] == [c.token_ids for c in samples]
    assert len({tuple(c.token_ids) for c in samples}) > 1  # each sample has its own stream
    other_seed = llm.generate(P_STORY, SamplingParams(n=3, temperature=0.8, seed=2, max_tokens=8))[0]
    assert [c.token_ids for c in other_seed.outputs] != [c.token_ids for c in samples]
    assert_drained(llm.engine)


def test_top_k_1_is_greedy(llm):
    want = llm.generate(P_STORY, greedy(max_tokens=8))[0].token_ids
    for seed in (None, 3):
        out = llm.generate(P_STORY, SamplingParams(n=2, temperature=0.8, top_k=1, seed=seed, max_tokens=8))[0]
        assert [c.token_ids for c in out.outputs] == [want, want]
    assert_drained(llm.engine)


def test_seeded_request_alone_equals_in_batch(llm):
    params = SamplingParams(temperature=0.8, seed=42, max_tokens=8)
    alone = [llm.generate(p, params)[0].token_ids for p in (P_FRANCE, P_STORY, P_CODE)]
    batch = llm.generate([P_FRANCE, P_STORY, P_CODE], params)
    assert [o.token_ids for o in batch] == alone
    assert_drained(llm.engine)


# ---------------------------------------------------------------- logprobs
def test_logprobs_top5_sorted_and_chosen_is_top1(llm):
    [out] = llm.generate(P_FRANCE, greedy(max_tokens=6, logprobs=True, top_logprobs=5))
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert isinstance(lp, TokenLogprob) and lp.token_id == token
        assert len(lp.top) == 5 and len({t for t, _ in lp.top}) == 5
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        assert sum(2.718281828459045 ** v for v in values) <= 1.0 + 1e-5
        assert lp.top[0][0] == token and lp.logprob == pytest.approx(lp.top[0][1], abs=1e-6)
    assert_drained(llm.engine)


def test_logprobs_are_those_of_the_raw_distribution(llm):
    params = dict(max_tokens=1, logprobs=True, top_logprobs=5)
    [base] = llm.generate(P_FRANCE, greedy(**params))
    runner_up, runner_up_lp = base.logprobs[0].top[1]
    [forced] = llm.generate(P_FRANCE, greedy(logit_bias={runner_up: 100.0}, **params))
    assert forced.token_ids == [runner_up]
    assert forced.logprobs[0].logprob == pytest.approx(runner_up_lp, abs=1e-4)  # not ~0 after the bias
    assert [t for t, _ in forced.logprobs[0].top] == [t for t, _ in base.logprobs[0].top]
    assert_drained(llm.engine)


# ---------------------------------------------------------------- logit_bias and penalties
def test_logit_bias_forces_and_bans(llm, tok):
    [banana] = tok.encode(" banana")
    [out] = llm.generate(P_FRANCE, greedy(max_tokens=4, logit_bias={banana: 100.0}))
    assert out.token_ids == [banana] * 4
    first = llm.generate(P_FRANCE, greedy(max_tokens=1))[0].token_ids[0]
    [banned] = llm.generate(P_FRANCE, greedy(max_tokens=1, logit_bias={first: -100.0}))
    assert banned.token_ids[0] != first
    assert_drained(llm.engine)


@pytest.mark.parametrize(
    "penalty", [dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=1.3)]
)
def test_penalties_reduce_repeats(llm, tok, penalty):
    [yes] = tok.encode(" yes")
    base = llm.generate(P_YES, greedy(max_tokens=12))[0].token_ids
    assert base.count(yes) >= 5  # the unpenalized model keeps saying " yes"
    penalized = llm.generate(P_YES, greedy(max_tokens=12, **penalty))[0].token_ids
    assert penalized.count(yes) < base.count(yes) - 2
    assert_drained(llm.engine)


# ---------------------------------------------------------------- min_tokens / ignore_eos
def test_min_tokens_and_ignore_eos(llm):
    [short] = llm.chat(SHORT_ANSWER, greedy(max_tokens=16))
    assert short.finish_reason == "stop" and len(short.token_ids) < 10  # greedy ends early by EOS
    eos = short.token_ids[-1]
    [held] = llm.chat(SHORT_ANSWER, greedy(max_tokens=16, min_tokens=10))
    assert len(held.token_ids) >= 10 and eos not in held.token_ids[:10]
    assert held.token_ids[: len(short.token_ids) - 1] == short.token_ids[:-1]  # same until EOS was due
    [forced] = llm.chat(SHORT_ANSWER, greedy(max_tokens=20, ignore_eos=True))
    assert len(forced.token_ids) == 20 and forced.finish_reason == "length"
    assert forced.token_ids[: len(short.token_ids)] == short.token_ids  # ran straight through EOS
    assert_drained(llm.engine)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "field, bad",
    [
        ("max_tokens", 0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("n", 0),
    ],
)
def test_bad_sampling_params_name_the_field(llm, field, bad):
    with pytest.raises(ValueError, match=f"^{field}"):
        llm.generate(P_FRANCE, SamplingParams(**{field: bad}))
    # Params that went bad after construction are still caught by generate and stream.
    params = SamplingParams(max_tokens=4)
    setattr(params, field, bad)
    with pytest.raises(ValueError, match=f"^{field}"):
        llm.generate(P_FRANCE, params)
    with pytest.raises(ValueError, match=f"^{field}"):
        list(llm.stream(P_FRANCE, params))
    _serves(llm)


def test_bad_prompts_and_lengths(llm):
    with pytest.raises(ValueError, match="^prompt"):
        llm.generate("", greedy(max_tokens=2))
    _serves(llm)
    with pytest.raises(ValueError, match="^prompt"):
        llm.generate([P_FRANCE, ""], greedy(max_tokens=2))  # nothing of the batch runs
    _serves(llm)
    with pytest.raises(ValueError, match="^prompt"):
        llm.generate([[1, 2, llm.engine.vocab_size]], greedy(max_tokens=2))
    _serves(llm)
    with pytest.raises(ValueError, match="^prompt"):
        list(llm.stream("", greedy(max_tokens=2)))
    _serves(llm)
    with pytest.raises(ValueError, match=r"^max_tokens.*100000.*context length \(8192\)"):
        llm.generate(P_FRANCE, greedy(max_tokens=100_000))
    _serves(llm)
    long_prompt = [tok_id % 1000 + 100 for tok_id in range(8190)]
    with pytest.raises(ValueError, match="^max_tokens"):  # prompt + max_tokens just over the context
        llm.generate(long_prompt, greedy(max_tokens=3))
    _serves(llm)
    # The second prompt fails after the first was queued: the first must not be left running.
    with pytest.raises(ValueError, match="^prompt"):
        llm.generate([[1, 2, 3], [llm.engine.vocab_size]], greedy(max_tokens=2))
    _serves(llm)
    with pytest.raises(ValueError, match="^logit_bias"):
        llm.generate(P_FRANCE, greedy(max_tokens=2, logit_bias={llm.engine.vocab_size: 1.0}))
    _serves(llm)
    with pytest.raises(ValueError, match="^n"):
        list(llm.stream(P_FRANCE, greedy(n=2, max_tokens=2)))
    _serves(llm)
    with pytest.raises(ValueError, match="^prompts"):
        llm.generate(None)
    with pytest.raises(ValueError, match="^params: .* one per prompt \\(2\\)"):
        llm.generate([P_FRANCE, P_STORY], [greedy(max_tokens=2)])
    _serves(llm)


def test_a_params_list_gives_each_prompt_its_own(llm):
    """vLLM's form: one SamplingParams per prompt; each output as if generated alone."""
    short, long = greedy(max_tokens=3), greedy(max_tokens=9)
    both = llm.generate([P_FRANCE, P_STORY], [short, long])
    assert [len(o.token_ids) for o in both] == [3, 9]
    assert [o.text for o in both] == [llm.generate(P_FRANCE, short)[0].text, llm.generate(P_STORY, long)[0].text]
    assert_drained(llm.engine)


def test_a_model_without_a_tokenizer_refuses_what_needs_text(tiny_config_path):
    """Token ids in and out work; stop strings (nothing to match them in) and stream() (it yields
    text) are refused naming the field, not ignored or silent."""
    tiny = LLM(tiny_config_path, dtype="float32", load_format="dummy", num_threads=1, kv_cache_memory=2 << 20)
    assert tiny.tokenizer is None
    assert len(tiny.generate([[5, 6, 7]], greedy(max_tokens=3))[0].token_ids) == 3
    with pytest.raises(ValueError, match="^stop: this model has no tokenizer"):
        tiny.generate([[5, 6, 7]], greedy(max_tokens=3, stop=["x"]))
    with pytest.raises(ValueError, match="^prompt: stream\\(\\) yields text"):
        tiny.stream([5, 6, 7], greedy(max_tokens=3))
    assert not tiny.engine.requests
    assert tiny.generate([[5, 6, 7]], greedy(max_tokens=2, stop_token_ids=[1]))[0].token_ids


def test_missing_model_file():
    with pytest.raises(ValueError, match="model"):
        LLM("/nonexistent/x.gguf")


@pytest.mark.parametrize("head", [b"", b"GGUF"])
def test_corrupt_model_file(tmp_path, head):
    path = tmp_path / "x.gguf"
    path.write_bytes(head + os.urandom(1024 - len(head)))
    with pytest.raises(ValueError, match="model"):
        LLM(str(path))


def test_truncated_model_file(tmp_path, smollm_path):
    path = tmp_path / "x.gguf"
    with open(smollm_path, "rb") as f:
        path.write_bytes(f.read(2_000_000))  # a download cut short: header intact, tensors missing
    with pytest.raises(ValueError, match="model"):
        LLM(str(path))


# ---------------------------------------------------------------- multi-byte characters
def test_stream_never_splits_a_character(llm, tok):
    ids = llm.encode_chat([{"role": "user", "content": "Repeat exactly: café 日本語 🙂"}])
    params = greedy(max_tokens=24)
    [out] = llm.generate(ids, params)
    # The test means something only if some character really spans several tokens.
    assert "日本語" in out.text and any("\ufffd" in tok.decode([t]) for t in out.token_ids)
    deltas = list(llm.stream(ids, params))
    assert len(deltas) > 1
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == out.text == tok.decode(out.token_ids)
    assert_drained(llm.engine)


def test_top_logprobs_alone_returns_logprobs(llm):
    [out] = llm.generate(P_FRANCE, greedy(max_tokens=3, top_logprobs=2))
    assert out.logprobs is not None and len(out.logprobs) == 3
    assert all(len(lp.top) == 2 and lp.top[0][0] == t for lp, t in zip(out.logprobs, out.token_ids, strict=True))
