"""`parallel_tool_calls: false`: the answer is the first call, and generation ends with it.

The parser knows a call is complete at the character that closes it (`calls_complete`); the server
watches each sample's text token by token (SampleText's `end`, ChatPlan.answer_end) and ends the
sample at the token that closed the call, as at a stop string: the engine stops, the tokens after
it are neither output nor counted in usage, and the choice finishes "tool_calls". Without the
limit (`parallel_tool_calls: true`, the default) nothing changes.
"""
from __future__ import annotations

import json

import openai
import pytest
from parser_cases import GOOD, Case, hermes
from server_util import running_server

from ketch.engine.outputs import EngineOutput
from ketch.parsers import ChatOutputParser
from ketch.sampling.params import SamplingParams
from ketch.server.tools import plan_chat
from ketch.text import Tokenizer
from ketch.text.sample_text import SampleText

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Add 1 and 2, then 3 and 4."}]
CLOSE = "</tool_call>"


def _message(kwargs: dict, text: str) -> dict:
    parser = ChatOutputParser(**kwargs)
    parser.feed(text)
    parser.finish()
    msg = parser.message()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    return {"content": msg["content"], "reasoning": msg["reasoning_content"], "calls": calls,
            "finish": parser.finish_reason("stop")}


# --- the parser: where the first call is complete ---------------------------------------------------


@pytest.mark.parametrize("case", [c for c in GOOD if c.calls], ids=lambda c: c.id)
def test_calls_complete_at_the_character_that_closes_the_first_call(case: Case) -> None:
    """Fed one character at a time, the parser says the one call allowed is complete at a point
    where the output may end without changing the answer (the rest is dropped anyway); without the
    limit it never says so."""
    kwargs = {**case.kwargs, "max_calls": 1}
    parser = ChatOutputParser(**kwargs)
    unlimited = ChatOutputParser(**case.kwargs)
    end = None
    for i, ch in enumerate(case.text):
        parser.feed(ch)
        unlimited.feed(ch)
        assert not unlimited.calls_complete
        if parser.calls_complete:
            end = i + 1
            break
    assert end is not None, "the first call never completed"
    cut = _message(kwargs, case.text[:end])
    assert cut == _message(kwargs, case.text) and cut["finish"] == "tool_calls" and len(cut["calls"]) == 1


# --- one sample's text: the end watched token by token ------------------------------------------------


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load()


def _plan(parallel: bool | None):
    fields = {"messages": ASK, "tools": [ADD], "tool_choice": "auto"}
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    return plan_chat(fields, None, None, None)  # SmolLM2's template: calls taught in hermes


def _delta(ids: list[int], finished: bool = False) -> EngineOutput:
    return EngineOutput("r", 0, ids, None, finished=finished, finish_reason="length" if finished else None)


TWO_CALLS = "Sure." + hermes("add", {"a": 1, "b": 2}) + "\n" + hermes("add", {"a": 3, "b": 4}) + "\nDone, more text."


def _first_call_tokens(tok: Tokenizer, ids: list[int]) -> int:
    return next(n for n in range(1, len(ids) + 1) if CLOSE in tok.decode(ids[:n]))


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_the_sample_ends_at_the_token_that_closes_the_one_call(tok, size):
    """Whatever the deltas' sizes (a verify's several tokens, a server's joined deltas): the ids
    kept, the text and the end are those of the token that completed `</tool_call>`."""
    ids = tok.encode(TWO_CALLS)
    n = _first_call_tokens(tok, ids)
    assert n < len(ids) - 10  # the second call and the text after it come later
    text = SampleText(tok, tok.encode("Hi"), SamplingParams(max_tokens=200), end=_plan(False).answer_end())
    out, used = "", 0
    for i in range(0, len(ids), size):
        piece, stopped, kept = text.push(_delta(ids[i:i + size], finished=i + size >= len(ids)))
        out, used = out + piece, used + kept
        assert stopped is None
        if text.ended:
            break
    assert text.ended and used == n and out == tok.decode(ids[:n])
    assert _message({"tool_parser": "hermes", "tools": [ADD], "max_calls": 1}, out)["calls"] == [
        ("add", '{"a": 1, "b": 2}')]


def test_min_tokens_holds_the_end_back_and_parallel_calls_have_none(tok):
    ids = tok.encode(TWO_CALLS)
    n = _first_call_tokens(tok, ids)
    text = SampleText(tok, tok.encode("Hi"), SamplingParams(max_tokens=200, min_tokens=n + 3),
                      end=_plan(False).answer_end())
    piece, _, kept = text.push(_delta(ids))
    assert text.ended and kept == n + 3 and piece == tok.decode(ids[:n + 3])
    assert _plan(True).answer_end() is None and _plan(None).answer_end() is None  # the default: unaffected


def test_a_resumed_stream_whose_text_has_the_whole_call_ended_there(tok):
    ids = tok.encode(TWO_CALLS)
    n = _first_call_tokens(tok, ids)
    params = SamplingParams(max_tokens=200)
    with pytest.raises(ValueError, match="parallel_tool_calls"):
        SampleText(tok, tok.encode("Hi"), params, ids[:n], end=_plan(False).answer_end())
    text = SampleText(tok, tok.encode("Hi"), params, ids[:n - 1], end=_plan(False).answer_end())
    piece, _, kept = text.push(_delta(ids[n - 1:]))
    assert text.ended and kept == 1 and text.resumed_text + piece == tok.decode(ids[:n])


# --- through `ketch serve` ----------------------------------------------------------------------------

# Under tool_choice "auto" no grammar holds the model to one call; this regex makes the greedy model
# write two or three calls whatever it would choose, so that the one-call limit has something to cut.
_CALL = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\n</tool_call>'
SEVERAL_CALLS = _CALL + r"\n" + _CALL + r"(\n" + _CALL + r")?"


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running


def _stream(client, **kw) -> tuple[list[tuple[str, str]], str | None, int, list[str]]:
    calls: dict[int, list[str]] = {}
    finish, usage, tokens = None, None, []
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            tokens += [t.token for t in (ch.logprobs.content if ch.logprobs else None) or []]
            for tc in ch.delta.tool_calls or []:
                name_args = calls.setdefault(tc.index, ["", ""])
                name_args[0] += tc.function.name or ""
                name_args[1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish, usage.completion_tokens, tokens


def test_generation_ends_with_the_one_call_allowed(client, model):
    kw = dict(model=model, messages=ASK, tools=[ADD], tool_choice="auto", max_tokens=120, temperature=0,
              logprobs=True, extra_body={"regex": SEVERAL_CALLS})
    # parallel calls (the default, and said outright): every call, generated to the grammar's end
    full = client.chat.completions.create(**kw)
    assert client.chat.completions.create(**kw, parallel_tool_calls=True).usage.completion_tokens == \
        full.usage.completion_tokens
    tokens = [t.token for t in full.choices[0].logprobs.content]
    calls = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    assert full.choices[0].finish_reason == "tool_calls" and len(calls) >= 2
    n = next(i for i in range(1, len(tokens) + 1) if CLOSE in "".join(tokens[:i]))
    assert full.usage.completion_tokens == len(tokens) > n + 10
    json.loads(calls[0][1])

    # one call: the greedy tokens are the same up to the end of the first call, and stop there
    one = client.chat.completions.create(**kw, parallel_tool_calls=False)
    choice = one.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == calls[:1]
    assert [t.token for t in choice.logprobs.content] == tokens[:n]
    assert one.usage.completion_tokens == n

    streamed, finish, used, stream_tokens = _stream(client, **kw, parallel_tool_calls=False)
    assert (streamed, finish, used, stream_tokens) == (calls[:1], "tool_calls", n, tokens[:n])
    streamed, finish, used, _ = _stream(client, **kw)  # and the stream of parallel calls is as before
    assert (streamed, finish, used) == (calls, "tool_calls", len(tokens))
