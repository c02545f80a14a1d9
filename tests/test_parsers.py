"""Reasoning and tool-call parsers: final messages, stream shape, and independence from chunking."""
from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest
from parser_cases import (
    ALL,
    BAD,
    CUT,
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    GOOD,
    Case,
    hermes,
)

from ketch.parsers import ChatOutputParser, reasoning_parser_class, tool_parser_class
from ketch.text import IncrementalDetokenizer, Tokenizer

SEEDS = range(5)


def random_chunks(text: str, seed: int, most: int = 9) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, most)
        out.append(text[i : i + n])
        i += n
    return out


def run(kwargs: dict[str, Any], chunks: list[str]) -> tuple[list[dict], dict]:
    parser = ChatOutputParser(**kwargs)
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    return [d for d in deltas if d is not None], parser.message()


def accumulate(deltas: list[dict]) -> dict:
    """What a client accumulating the stream sees (as the OpenAI SDK does), checking each delta."""
    content, reasoning, calls = [], [], []
    for d in deltas:
        assert d and set(d) <= {"content", "reasoning_content", "tool_calls"}, d
        for key, out in (("content", content), ("reasoning_content", reasoning)):
            if key in d:
                assert isinstance(d[key], str) and d[key], d
                out.append(d[key])
        for tc in d.get("tool_calls", []):
            i = tc["index"]
            if i == len(calls):  # first piece of a new call: id, type and name
                assert set(tc) == {"index", "id", "type", "function"} and tc["type"] == "function", tc
                assert isinstance(tc["id"], str) and tc["id"] and tc["function"]["name"], tc
                calls.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": tc["function"]["arguments"]})
            else:  # a later piece: index and an argument piece only
                assert i < len(calls) and set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                assert tc["function"]["arguments"], tc
                calls[i]["arguments"] += tc["function"]["arguments"]
        indices = [tc["index"] for tc in d.get("tool_calls", [])]
        assert len(indices) == len(set(indices)), d  # one entry per call per delta
    return {"content": "".join(content), "reasoning": "".join(reasoning), "calls": calls}


def comparable(msg: dict) -> dict:
    """The final message without the random call ids."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    return {"content": msg["content"], "reasoning": msg["reasoning_content"], "calls": calls}


def check_stream(case: Case, deltas: list[dict], msg: dict) -> None:
    seen = accumulate(deltas)
    assert seen["content"] == (msg["content"] or "")
    assert seen["reasoning"] == (msg["reasoning_content"] or "")
    final = msg.get("tool_calls", [])
    for got, want in zip(seen["calls"], final):  # same id on every piece, arguments joined exactly
        assert got == {"id": want["id"], "name": want["function"]["name"], "arguments": want["function"]["arguments"]}
    extra = len(seen["calls"]) - len(final)
    # Only a malformed output may leave one call on the stream that broke after it was announced.
    assert extra == 0 or (case.malformed and extra == 1), (seen["calls"], final)
    assert len({c["id"] for c in seen["calls"]}) == len(seen["calls"])


def check_expected(case: Case, msg: dict) -> None:
    assert msg["role"] == "assistant"
    assert msg["content"] == case.content
    assert msg["reasoning_content"] == case.reasoning
    calls = msg.get("tool_calls", [])
    if case.cut_call is not None:  # the last call keeps its unfinished arguments as they were read
        *calls, cut = calls
        assert (cut["function"]["name"], cut["function"]["arguments"]) == case.cut_call
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == case.calls
    for c in calls:
        assert c["type"] == "function" and isinstance(json.loads(c["function"]["arguments"]), dict)


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.id)
def test_whole_output(case: Case) -> None:
    deltas, msg = run(case.kwargs, [case.text])
    check_expected(case, msg)
    check_stream(case, deltas, msg)
    assert comparable(ChatOutputParser.parse(case.text, **case.kwargs)) == comparable(msg)


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.id)
def test_any_chunking_gives_the_same_message(case: Case) -> None:
    whole = comparable(run(case.kwargs, [case.text])[1])
    splits = [list(case.text)] + [random_chunks(case.text, seed) for seed in SEEDS]
    for chunks in splits:
        deltas, msg = run(case.kwargs, chunks)
        assert comparable(msg) == whole, chunks
        check_stream(case, deltas, msg)


@pytest.mark.parametrize("case", GOOD, ids=lambda c: c.id)
def test_streamed_arguments_are_the_raw_json(case: Case) -> None:
    # Object arguments stream as the model wrote them, so a client sees them take shape.
    _, msg = run(case.kwargs, list(case.text))
    for call in msg.get("tool_calls", []):
        args = call["function"]["arguments"]
        # as written; or, for string-encoded arguments, decoded from the string; or absent: "{}"
        assert args in case.text or json.dumps(args)[1:-1] in case.text or args == "{}"


def test_streaming_announces_calls_before_they_end() -> None:
    text = hermes("get_weather", {"city": "Paris", "days": [1, 2, 3]})
    parser = ChatOutputParser(tool_parser="hermes")
    first_at = None
    for i, ch in enumerate(text):
        d = parser.feed(ch)
        if d and "tool_calls" in d and first_at is None:
            first_at = i
    assert first_at is not None and first_at < text.index('"city"')
    assert parser.finish() is None


def test_possible_tag_is_held_then_released() -> None:
    parser = ChatOutputParser(tool_parser="hermes")
    assert parser.feed("Hi <tool_") == {"content": "Hi"}  # " <tool_" may open a call
    assert parser.feed("box> ok") == {"content": " <tool_box> ok"}
    assert parser.finish() is None


# --- one token at a time through the real detokenizer ------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load()


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.id)
def test_token_by_token(case: Case, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(case.text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == case.text  # the parser sees exactly the model's text
    deltas, msg = run(case.kwargs, [p for p in pieces if p])
    assert comparable(msg) == comparable(run(case.kwargs, [case.text])[1])
    check_expected(case, msg)
    check_stream(case, deltas, msg)


# --- truncation anywhere ------------------------------------------------------------------------


@pytest.mark.parametrize("case", GOOD, ids=lambda c: c.id)
def test_cut_anywhere_never_raises_and_does_not_depend_on_chunking(case: Case) -> None:
    rng = random.Random(case.id)
    for cut in sorted(rng.sample(range(len(case.text)), min(12, len(case.text)))):
        prefix = case.text[:cut]
        whole = comparable(run(case.kwargs, [prefix])[1])
        deltas, msg = run(case.kwargs, random_chunks(prefix, cut, most=4))
        assert comparable(msg) == whole, prefix
        # A cut is not malformed output: the stream and the message hold exactly the same calls.
        check_stream(Case(case.id, case.kwargs, prefix, None), deltas, msg)


def test_call_cut_by_max_tokens_is_reported_alike_streamed_and_whole() -> None:
    # tool_choice "required" with parallel calls: a second call cut inside its arguments.
    full = hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("get_weather", {"city": "London"})
    text = full[: full.index("ndon")]
    kwargs = {"tool_parser": "hermes", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}
    whole = ChatOutputParser(**kwargs)
    whole.feed(text)
    whole.finish()
    want = [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lo')]
    assert comparable(whole.message()) == {"content": None, "reasoning": None, "calls": want}
    for chunks in (list(text), random_chunks(text, 7, most=5)):
        stream = ChatOutputParser(**kwargs)
        deltas = [d for d in [*(stream.feed(c) for c in chunks), stream.finish()] if d]
        seen = accumulate(deltas)
        assert seen["content"] == "" and [(c["name"], c["arguments"]) for c in seen["calls"]] == want
        assert comparable(stream.message()) == comparable(whole.message())
        assert stream.truncated and stream.finish_reason("length") == "length"
    # Cut, the arguments are unfinished: never "tool_calls", even when a stop string ended it.
    assert whole.finish_reason("stop") == "stop"
    complete = ChatOutputParser(**kwargs)
    complete.feed(full)
    complete.finish()
    assert not complete.truncated and complete.finish_reason("stop") == "tool_calls"
    assert complete.finish_reason("length") == "length"


def test_call_cut_after_its_arguments_is_whole() -> None:
    # Only the close tag is missing (a stop string, or the model's end): the call is complete.
    parser = ChatOutputParser(tool_parser="hermes")
    parser.feed('<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_')
    parser.finish()
    assert not parser.truncated and parser.finish_reason("stop") == "tool_calls"
    assert comparable(parser.message())["calls"] == [("get_time", '{"tz": "CET"}')]


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>",
    DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP, "```json", "```", "function", "get_time",
    '"name"', '"arguments"', '"parameters"', '"get_time"', '"x"', "{", "}", "[", "]", ":", ",", ";", " ", "\n", "1",
    "<", "ab", "é🙂",
]
def _mutate(rng: random.Random, cases: list[Case]) -> tuple[dict[str, Any], str]:
    """A realistic output, often damaged: spans cut or repeated, fragments dropped in, two joined."""
    base = rng.choice(cases)
    text = base.text
    for _ in range(rng.choice((0, 1, 1, 2, 3))):
        i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
        op = rng.randrange(4)
        if op == 0:
            text = text[:i] + text[j:]
        elif op == 1:
            text = text[:j] + text[i:j] + text[j:]
        elif op == 2:
            text = text[:i] + rng.choice(FRAGMENTS) + text[i:]
        else:
            text = text + rng.choice(cases).text
    return base.kwargs, text or "x"


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral", "deepseek-v3"])
def test_damaged_outputs_never_raise_and_do_not_depend_on_chunking(parser: str) -> None:
    cases = [c for c in GOOD if c.kwargs.get("tool_parser") == parser]
    rng = random.Random(parser)
    with_calls = 0
    for i in range(150):
        kwargs, text = _mutate(rng, cases)
        probe = Case("fuzz", kwargs, text, None, malformed=True)
        deltas, msg = run(kwargs, [text])
        check_stream(probe, deltas, msg)
        with_calls += bool(msg.get("tool_calls"))
        for chunks in (list(text), random_chunks(text, i, most=6)):
            deltas, other = run(kwargs, chunks)
            assert comparable(other) == comparable(msg), text
            check_stream(probe, deltas, other)
    assert with_calls > 30  # the damage leaves many outputs with calls: both paths are exercised


def test_absurd_nesting_is_content_not_a_crash() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    as_string = '<tool_call>{"name": "f", "arguments": ' + json.dumps(deep) + "}</tool_call>"
    assert ChatOutputParser.parse(as_string, tool_parser="hermes")["content"] == as_string
    as_object = '<tool_call>{"name": "f", "arguments": {"a": ' + deep + "}}</tool_call>"
    msg = ChatOutputParser.parse(as_object, tool_parser="hermes")  # valid JSON, scanned without recursion
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"a": ' + deep + "}"


def test_broken_calls_keep_every_character_as_content() -> None:
    # A call that breaks, or is cut before its name was read, gives back its text untouched.
    for case in BAD + CUT:
        if not case.calls and case.cut_call is None:
            assert ChatOutputParser.parse(case.text, **case.kwargs)["content"] == case.text


# --- parser classes directly ----------------------------------------------------------------------


def test_parser_results_match_the_message() -> None:
    cls = tool_parser_class("hermes")
    p = cls(frozenset({"get_time"}))
    p.feed("ok " + hermes("get_time", {}))
    p.finish()
    res = p.result()
    assert res.content == "ok" and [c.name for c in res.calls] == ["get_time"] and res.calls[0].id.startswith("call_")
    r = reasoning_parser_class("deepseek-r1")()
    r.feed("why\n</think>\nbecause")
    r.finish()
    assert (r.result().reasoning, r.result().content) == ("why", "because")


def test_mistral_ids_are_nine_alphanumerics() -> None:
    msg = ChatOutputParser.parse("[TOOL_CALLS]get_time[ARGS]{}", tool_parser="mistral")
    call_id = msg["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum()


def test_unknown_parser_names_are_value_errors() -> None:
    with pytest.raises(ValueError, match="tool_call_parser"):
        ChatOutputParser(tool_parser="nope")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ChatOutputParser(reasoning_parser="nope")


def test_feed_after_finish_is_an_error() -> None:
    parser = ChatOutputParser(tool_parser="hermes", reasoning_parser="qwen3")
    parser.feed("x")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("y")


def test_without_tool_list_any_name_is_a_call() -> None:
    msg = ChatOutputParser.parse(hermes("anything", {"a": 1}), tool_parser="hermes")
    assert msg["tool_calls"][0]["function"]["name"] == "anything"


# --- the OpenAI SDK's own stream accumulation -------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in GOOD + CUT if c.calls or c.cut_call], ids=lambda c: c.id)
def test_openai_sdk_accumulates_the_stream_into_the_final_message(case: Case) -> None:
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    deltas, msg = run(case.kwargs, random_chunks(case.text, 1, most=5))
    state = ChatCompletionStreamState()
    for i, delta in enumerate(deltas):
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": {"role": "assistant", **delta} if i == 0 else delta, "finish_reason": None}],
        }
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    last = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "length" if case.cut_call else "tool_calls"}]}
    state.handle_chunk(ChatCompletionChunk.model_validate(last))
    # the snapshot: get_final_completion() refuses a "length" finish (it would parse the content)
    got = state.current_completion_snapshot.choices[0].message
    assert [(c.id, c.function.name, c.function.arguments) for c in got.tool_calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]
    ]
    assert (got.content or None) == msg["content"]


# --- max_calls (parallel_tool_calls: false) ---------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in GOOD if len(c.calls) > 1], ids=lambda c: c.id)
def test_max_calls_keeps_the_first_call_alike_streamed_and_whole(case: Case) -> None:
    """The answer ends with the first call: the later ones are never announced on the stream, so
    the stream and the whole answer agree, and a max_tokens cut after it does not make it "length"."""
    kwargs = {**case.kwargs, "max_calls": 1}
    whole = ChatOutputParser(**kwargs)
    whole.feed(case.text)
    whole.finish()
    msg = whole.message()
    check_expected(dataclasses.replace(case, calls=case.calls[:1]), msg)
    for seed in SEEDS:
        deltas, streamed = run(kwargs, random_chunks(case.text, seed))
        check_stream(case, deltas, streamed)
        assert len(accumulate(deltas)["calls"]) == 1 and comparable(streamed) == comparable(msg)
    assert whole.finish_reason("length") == "tool_calls" and whole.finish_reason("stop") == "tool_calls"
    unlimited = ChatOutputParser(**case.kwargs)
    unlimited.feed(case.text)
    unlimited.finish()
    assert len(unlimited.message()["tool_calls"]) == len(case.calls) and unlimited.finish_reason("length") == "length"
