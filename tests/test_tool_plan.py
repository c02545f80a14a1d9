"""ketch/server/tools.py's plan_chat, as the chat route calls it (no engine needed): bad tools are
OpenAI 400s naming the field, and `parallel_tool_calls: false` holds under every tool_choice, in the
stream and the whole answer alike."""
from __future__ import annotations

import json
from typing import Any

import pytest
from parser_cases import hermes

from ketch.server.errors import APIError
from ketch.server.tools import ChatPlan, plan_chat

ASK = [{"role": "user", "content": "Weather in Paris and Berlin?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TWO_CALLS = hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("get_weather", {"city": "Berlin"}) + "\n"


def plan(**fields: Any) -> ChatPlan:
    # template None: no tool support, so the tools go into the system prompt and hermes reads calls
    return plan_chat({"messages": ASK, **fields}, None, None, None)


@pytest.mark.parametrize("fn, param", [
    ({"name": 'get"weather'}, "tools[0].function.name"),
    ({"name": "x" * 65}, "tools[0].function.name"),
    ({"name": "lookup", "parameters": {"type": "string"}}, "tools[0].function.parameters"),
    ({"name": "lookup", "parameters": {"type": "array", "items": {"type": "string"}}}, "tools[0].function.parameters"),
])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_bad_tools_are_400s_naming_the_field(fn, param, choice):
    with pytest.raises(APIError) as info:
        plan(tools=[{"type": "function", "function": fn}], tool_choice=choice)
    error = info.value.body()["error"]
    assert info.value.status == 400 and error["param"] == param and error["message"].startswith(param + ": "), error


def _answers(p: ChatPlan, text: str, engine_reason: str) -> list[tuple[list, str | None]]:
    """(calls, finish_reason) of the whole answer, then of the stream fed one character at a time."""
    whole = p.output_parser()
    whole.feed(text)
    whole.finish()
    out = [([(c.name, json.loads(c.arguments)) for c in whole.tool_calls], whole.finish_reason(engine_reason))]
    stream = p.output_parser()
    deltas = [stream.feed(ch) for ch in text] + [stream.finish()]
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in (d or {}).get("tool_calls", []):
            piece = calls.setdefault(tc["index"], [tc["function"].get("name"), ""])
            piece[1] += tc["function"]["arguments"]
    out.append(([(name, json.loads(args)) for name, args in calls.values()], stream.finish_reason(engine_reason)))
    return out


@pytest.mark.parametrize("choice", [None, "auto", "required"])
def test_parallel_tool_calls_false_keeps_one_call(choice):
    fields = {"tools": [WEATHER], **({"tool_choice": choice} if choice else {})}
    one = plan(**fields, parallel_tool_calls=False)
    assert one.forced_grammar is None or choice == "required"
    first = [("get_weather", {"city": "Paris"})]
    # the model went on after its first call and max_tokens cut it: the answer is that first call
    assert _answers(one, TWO_CALLS, "length") == [(first, "tool_calls")] * 2
    assert _answers(one, TWO_CALLS, "stop") == [(first, "tool_calls")] * 2
    both = first + [("get_weather", {"city": "Berlin"})]
    for parallel in ({}, {"parallel_tool_calls": True}):
        assert _answers(plan(**fields, **parallel), TWO_CALLS, "stop") == [(both, "tool_calls")] * 2
