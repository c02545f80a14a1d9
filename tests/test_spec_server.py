"""Speculative decoding behind the OpenAI API: a real `ketch serve --speculative-algorithm ngram`
(fp32 CPU) answers greedy chat requests, streamed and not, with exactly the text the engine gives
without speculation; /metrics counts proposed and kept draft tokens and the acceptance-length
histogram; `ketch bench serve` reports the acceptance length of its run; every page comes back."""
from __future__ import annotations

import json

import openai
import pytest

from ketch.cli import main
from ketch.llm import LLM
from ketch.sampling.params import SamplingParams
from server_util import metrics, pages_all_back, running_server

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
CHATS = [[{"role": "user", "content": f"Repeat this code exactly:\n{CODE}"}],
         [{"role": "user", "content": f"Rewrite this code with `x` and `y` instead of `a` and `b`:\n{CODE}"}]]


@pytest.fixture(scope="module")
def server():
    with running_server("--speculative-algorithm", "ngram", "--speculative-adaptive", "off") as running:
        yield running


@pytest.fixture(scope="module")
def plain_llm(smollm_path) -> LLM:
    return LLM(smollm_path, dtype="float32", num_threads=1)


@pytest.fixture(scope="module")
def spec_llm(smollm_path) -> LLM:
    llm = LLM(smollm_path, dtype="float32", num_threads=1, speculative_algorithm="ngram", speculative_adaptive=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def reference(plain_llm) -> list[str]:
    return [o.text for o in plain_llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=60))]


def test_greedy_chat_streamed_and_not_equals_no_speculation(server, model, reference):
    client = openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0, timeout=300)
    for messages, want in zip(CHATS, reference, strict=True):
        full = client.chat.completions.create(model=model, messages=messages, temperature=0.0, max_tokens=60)
        assert full.choices[0].message.content == want
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=messages, temperature=0.0, max_tokens=60, stream=True) if c.choices]
        assert "".join(pieces) == want
    m = metrics(server[1])
    proposed = m['ketch_spec_proposed_tokens_total{proposer="ngram"}']
    accepted = m['ketch_spec_accepted_tokens_total{proposer="ngram"}']
    verifies = m['ketch_spec_verifies_total{proposer="ngram"}']
    assert 0 < accepted < proposed
    assert m['ketch_spec_accept_length_count{proposer="ngram"}'] == verifies
    assert m['ketch_spec_accept_length_sum{proposer="ngram"}'] == verifies + accepted
    assert pages_all_back(m)


def test_bench_serve_reports_the_acceptance_length(server, tmp_path, capsys):
    out_file = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", server[1], "--num-prompts", "3", "--random-input-len", "32",
               "--random-output-len", "24", "--max-concurrency", "3", "--disable-tqdm", "--temperature", "0",
               "--output-file", str(out_file)])
    assert rc == 0
    steps = json.loads(out_file.read_text())["metrics"]["engine"]
    assert steps["spec_accept_length"] >= 1.0 and 0.0 <= steps["spec_acceptance_rate"] <= 1.0
    assert "Speculative decoding: mean acceptance length" in capsys.readouterr().out


# a text the n-gram proposer drafts from at once: a verify keeps several tokens per step
ECHO = "the cat sat on the mat. the dog sat on the log. " * 3 + "the dog"
STOPS = [dict(stop=["log."]),  # completed inside a verify's kept tokens, with tokens after it
         dict(stop=["the"], min_tokens=4)]  # a "the" before min_tokens inside a multi-token delta


@pytest.mark.parametrize("stop", STOPS, ids=["inside-a-verify", "before-min-tokens"])
def test_stop_strings_end_the_output_at_the_same_token_as_without_speculation(server, model, plain_llm, spec_llm,
                                                                             stop):
    """Stop strings are checked token by token, not per delta: with a verify's several tokens in
    one delta, text, token ids, logprobs and usage end at the token that completed the stop, as
    without speculation (before: the delta's later ids stayed, or a "the" before min_tokens counted)."""
    [want] = plain_llm.generate([ECHO], SamplingParams(temperature=0.0, max_tokens=24, logprobs=True, **stop))
    assert want.finish_reason == "stop"
    client = openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0, timeout=300)
    got = client.completions.create(model=model, prompt=ECHO, temperature=0.0, max_tokens=24, logprobs=1,
                                    extra_body=stop)
    choice = got.choices[0]
    assert (choice.text, choice.finish_reason) == (want.text, "stop")
    assert len(choice.logprobs.tokens) == got.usage.completion_tokens == len(want.token_ids)
    accepted = spec_llm.engine.spec.stats.accepted_tokens
    [offline] = spec_llm.generate([ECHO], SamplingParams(temperature=0.0, max_tokens=24, logprobs=True, **stop))
    assert spec_llm.engine.spec.stats.accepted_tokens > accepted  # a verify kept drafts: several tokens a delta
    assert (offline.text, offline.token_ids, offline.finish_reason) == (want.text, want.token_ids, "stop")
    assert [lp.token_id for lp in offline.logprobs] == want.token_ids
