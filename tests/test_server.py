"""`ketch serve` end to end: a real server process on loopback, driven by the official openai SDK.

One server (bundled SmolLM2, fp32, one thread) serves the whole module; greedy wherever the
assertion is about text, seeded where sampling itself is under test. The last test kills the
engine process and expects the server to exit non-zero.
"""
from __future__ import annotations

import asyncio
import os

import openai
import pytest
import torch
from server_util import health, open_stream, post, running_server

from ketch.text.tokenizer import Tokenizer

MATH = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
STORY = [{"role": "user", "content": "Tell me a very short story about a cat."}]


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running




def test_models(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model] and models[0].object == "model"
    card = client.models.retrieve(model)  # GET /v1/models/{model}
    assert card.id == model and card.object == "model" and card.created == models[0].created
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.code == "model_not_found"


def test_chat_stream_matches_non_stream(client, model):
    full = client.chat.completions.create(model=model, messages=STORY, max_tokens=40, temperature=0)
    choice = full.choices[0]
    assert full.id.startswith("chatcmpl-") and full.model == model and full.created > 0
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=model, messages=STORY, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [choice.finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens)
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: a prefix-cache hit


def test_completions_text_and_token_ids(client, model):
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert "Paris" in out.choices[0].text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    by_ids = client.completions.create(model=model, prompt=[504, 3575, 282, 4649, 314], max_tokens=4, temperature=0)
    assert by_ids.usage.prompt_tokens == 5 and by_ids.usage.completion_tokens == 4


def test_completions_echo(client, model):
    plain = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=[504, 3575, 282], max_tokens=4, temperature=0, echo=True, stream=True) if c.choices)
    by_ids = client.completions.create(model=model, prompt=[504, 3575, 282], max_tokens=4, temperature=0)
    assert streamed.endswith(by_ids.choices[0].text) and len(streamed) > len(by_ids.choices[0].text)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hi", max_tokens=2, echo=True, logprobs=1)
    assert info.value.response.json()["error"]["param"] == "echo"
    # ids the tokenizer cannot decode are the prompt's 400, with echo as without (decode raised: a 500)
    for ids in ([-1], [2**40], [504, 10**9]):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model=model, prompt=ids, max_tokens=2, echo=True, stream=stream)
            assert info.value.response.json()["error"]["param"] == "prompt", (ids, stream)


def test_completions_stream_and_stop(client, model):
    full = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == full.choices[0].text
    stopped = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                        temperature=0, stop=["."])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full.choices[0].text.split(".")[0]
    assert stopped.choices[0].model_extra["matched_stop"] == "."


def test_completion_text_offsets_stream_as_whole(client, model, smollm_path):
    """text_offset with tokens inside a character (logit_bias forces the pieces of two emoji): the
    streamed offsets are the whole response's, and stay inside its text."""
    tok = Tokenizer.load(smollm_path)  # the server's model: its vocabulary
    pieces = [i for i in tok.encode("🎉🐍", add_special_tokens=False) if "\ufffd" in tok.decode([i])]
    kw = dict(model=model, prompt="Party:", max_tokens=6, temperature=0, logprobs=1,
              logit_bias={str(i): 100 for i in pieces})
    whole = client.completions.create(**kw).choices[0]
    offsets = whole.logprobs.text_offset
    assert any(t.startswith("bytes:") for t in whole.logprobs.tokens)  # the case at hand
    assert offsets[0] == 0 and all(a <= b for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1] < len(whole.text)
    streamed = [o for c in client.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                for o in c.choices[0].logprobs.text_offset]
    assert streamed == offsets


def test_completion_stream_sends_no_empty_chunks_inside_a_character(client, model, smollm_path):
    """Tokens that end inside a character (the pieces of two emoji, forced by logit_bias) give no
    text yet: without logprobs or token ids a stream sends nothing for them (as chat does), and
    what it sends joins into the whole answer's text."""
    tok = Tokenizer.load(smollm_path)
    pieces = [i for i in tok.encode("🎉🐍", add_special_tokens=False) if "\ufffd" in tok.decode([i])]
    kw = dict(model=model, prompt="Party:", max_tokens=6, temperature=0, logit_bias={str(i): 100 for i in pieces})
    whole = client.completions.create(**kw).choices[0].text
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert all(c.text for c in chunks if c.finish_reason is None), [c.text for c in chunks]
    assert "".join(c.text for c in chunks) == whole
    assert len(chunks) < 6  # fewer than one per token: some tokens ended inside a character


def test_n_and_seed(client, model):
    kw = dict(model=model, messages=STORY, max_tokens=12, temperature=0.8, seed=1234)
    a = client.chat.completions.create(n=2, **kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    b = client.chat.completions.create(n=2, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens > 0
    sampled = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    assert sampled[0] != sampled[1]  # each choice draws from its own stream (seed + index)
    greedy = client.chat.completions.create(n=2, **{**kw, "temperature": 0})
    assert greedy.choices[0].message.content == greedy.choices[1].message.content  # nothing random left
    # temperature shapes the draws: the same seed at another temperature gives another text
    hotter = client.chat.completions.create(n=1, **{**kw, "temperature": 1.6})
    assert hotter.choices[0].message.content != sampled[0]


@pytest.mark.parametrize("kw, param", [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature")])
def test_bad_values_are_400_and_server_keeps_serving(client, model, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MATH, **{"max_tokens": 4, **kw})
    error = info.value.response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert client.chat.completions.create(model=model, messages=MATH, max_tokens=2, temperature=0).choices


def test_prompt_over_context_is_400(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=10**6)
    assert info.value.response.json()["error"]["param"] == "max_tokens"


def test_async_client_concurrent_streams(server, client, model):
    async def one(aclient: openai.AsyncOpenAI, i: int) -> str:
        stream = await aclient.completions.create(model=model, prompt=f"Count: {i}, {i + 1},", max_tokens=6,
                                                  temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(4)))

    texts = asyncio.run(main())
    for i, text in enumerate(texts):  # batched greedy == alone
        alone = client.completions.create(model=model, prompt=f"Count: {i}, {i + 1},", max_tokens=6, temperature=0)
        assert text == alone.choices[0].text


def test_greedy_chat_matches_llm(client, model):
    from ketch import LLM, SamplingParams

    served = client.chat.completions.create(model=model, messages=STORY, max_tokens=32, temperature=0)
    threads = torch.get_num_threads()  # num_threads sets torch's global count: give it back after
    try:
        llm = LLM(dtype="float32", num_threads=1)
        offline = llm.chat(STORY, SamplingParams(temperature=0, max_tokens=32))[0]
    finally:
        torch.set_num_threads(threads)
    assert served.choices[0].message.content == offline.text
    assert served.choices[0].finish_reason == offline.finish_reason


def test_tokenize_and_detokenize(server, client, model):
    base = server[1]
    status, out = post(base, "/tokenize", {"messages": MATH})
    assert status == 200 and out["count"] == len(out["tokens"]) > 0
    chat = client.chat.completions.create(model=model, messages=MATH, max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens == out["count"]  # /tokenize sees exactly the prompt the chat route builds
    status, text = post(base, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert status == 200 and text["count"] >= 2
    status, back = post(base, "/detokenize", {"tokens": text["tokens"]})
    assert status == 200 and back["prompt"] == "Hello world"
    status, err = post(base, "/detokenize", {"tokens": ["x"]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, err = post(base, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and err["error"]["param"] == "tokens"


TOOL_HISTORY = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "a", "content": "sunny"}]


def test_tokenize_counts_a_tool_history_as_chat_does(server, client, model):
    """/tokenize shapes messages as the chat route does (its tool-call history rewrite), so agents can count."""
    status, out = post(server[1], "/tokenize", {"messages": TOOL_HISTORY})
    assert status == 200, out
    chat = client.chat.completions.create(model=model, messages=TOOL_HISTORY, max_tokens=1, temperature=0)
    assert chat.usage.prompt_tokens == out["count"]


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(server, client, model, smollm_path):
    """A text longer than the context's tokens times the most bytes a token covers: a 400 from its
    length alone (a message that tokenizing would not write)."""
    status, out = post(server[1], "/tokenize", {"prompt": "hi"})
    assert status == 200
    phrase = "All work and no play makes Jack a dull boy. "
    huge = phrase * (out["max_model_len"] * Tokenizer.load(smollm_path).max_bytes_per_token // len(phrase) + 1)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=huge, max_tokens=1)
    with pytest.raises(openai.BadRequestError) as chat_info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": huge}], max_tokens=1)
    for error, param in ((info.value.body, "prompt"), (chat_info.value.body, "messages")):
        assert error["param"] == param and error["code"] == "context_length_exceeded", error
        assert error["message"].startswith(f"{param}: the prompt has at least "), error
    assert health(server[1]) == 200
    assert client.completions.create(model=model, prompt="hi", max_tokens=1, temperature=0).choices


def test_api_key():
    with running_server("--api-key", "s3cret") as (_, base):
        assert health(base) == 200  # health needs no key
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0, timeout=60)
        model = good.models.list().data[0].id
        out = good.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=0)
        assert out.choices[0].text
        for key in ("wrong", ""):
            bad = openai.OpenAI(base_url=f"{base}/v1", api_key=key or "x", max_retries=0, timeout=60,
                                default_headers={} if key else {"Authorization": ""})
            with pytest.raises(openai.AuthenticationError) as e:
                bad.models.list()
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        status, err = post(base, "/tokenize", {"prompt": "hi"})  # no Authorization header at all
        assert status == 401 and set(err["error"]) == {"message", "type", "param", "code"}
        assert good.completions.create(model=model, prompt="Hi", max_tokens=2).choices  # still serving


def test_engine_death_fails_in_flight_requests_and_exits_nonzero(server, model):
    proc, base = server
    _, stream = open_stream(base, "/v1/completions", {"model": model, "prompt": "Once upon a time",
                                                      "max_tokens": 4000, "ignore_eos": True})
    children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    engine = [int(p) for p in children if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(engine) == 1
    os.kill(engine[0], 9)
    rest = stream.read().decode()  # the stream ends with an error event, not a hang
    assert '"code": "engine_unavailable"' in rest and rest.rstrip().endswith("data: [DONE]")
    assert "(code -9)" in rest  # the exit code is collected before it is reported (not "code None")
    assert proc.wait(timeout=30) != 0
    assert "the engine process exited (code -9)" in proc.stdout.read()
