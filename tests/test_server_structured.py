"""Structured output and tool calls through `ketch serve` with the official openai SDK: JSON
schema, regex and EBNF outputs validate; forced tool calls always parse and validate; `auto`
tools on a fixed transcript; bad grammars and tool schemas are 400s and the server serves on."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from server_util import health, metrics, running_server

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}
CITY = [{"role": "user", "content": "Name a large city and its population, as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running




def test_json_schema_validates_for_20_seeds(server, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0, timeout=300) as c:
            outs = await asyncio.gather(*(c.chat.completions.create(
                model=model, messages=CITY, temperature=1.0, seed=seed, max_tokens=60, response_format=fmt)
                for seed in range(20)))
        return [o.choices[0].message.content for o in outs if o.choices[0].finish_reason == "stop"]

    texts = asyncio.run(main())
    assert len(texts) == 20
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1


def test_json_streaming_with_n_and_completions_json_object(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    stream = client.chat.completions.create(model=model, messages=CITY, temperature=1.0, seed=5, n=2,
                                            max_tokens=60, response_format=fmt, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    out = client.completions.create(model=model, prompt="A JSON object describing a dog:", max_tokens=60,
                                    temperature=0, extra_body={"response_format": {"type": "json_object"}})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    else:  # cut by max_tokens: still a prefix of JSON, starting an object
        assert out.choices[0].text.lstrip().startswith("{")


def test_json_schema_without_a_schema_is_any_json_object(client, model):
    """OpenAI's json_schema.schema is optional: without one, the output is a JSON object."""
    out = client.chat.completions.create(model=model, messages=CITY, max_tokens=60, temperature=0,
                                         response_format={"type": "json_schema", "json_schema": {"name": "any"}})
    text = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of JSON, starting an object
        assert text.lstrip().startswith("{")


def test_regex_and_ebnf(client, model):
    pattern = r"[A-Z][a-z]+ [0-9]{4}"
    out = client.completions.create(model=model, prompt="A city and a year:", max_tokens=20, temperature=0.9,
                                    seed=3, extra_body={"regex": pattern})
    assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text
    ebnf = 'root ::= verdict ": " word\nverdict ::= "yes" | "no"\nword ::= [a-z]{2,12}'
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is water wet?"}],
                                          max_tokens=20, temperature=0.9, seed=4, extra_body={"ebnf": ebnf})
    assert re.fullmatch(r"(yes|no): [a-z]{2,12}", chat.choices[0].message.content), chat.choices[0].message.content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_always_valid(client, model, choice):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    for seed in range(3):
        r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed)
        choice0 = r.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.tool_calls
        for call in choice0.message.tool_calls:
            assert call.type == "function" and call.id
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"
    # streaming: the SDK-style accumulation of argument pieces gives the same valid call
    stream = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                            parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": tc.id})
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), schemas[calls[0]["name"]])
    whole = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
    assert (whole.choices[0].message.tool_calls[0].function.name, whole.choices[0].message.tool_calls[0].function.arguments) == (
        calls[0]["name"], calls[0]["arguments"])


def test_call_cut_by_max_tokens_is_the_same_streamed_and_whole(client, model):
    kw = dict(model=model, messages=[{"role": "user", "content": "What's the weather in Paris and in London?"}],
              tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=True, temperature=0)
    # Greedy output depends only on the prompt: read its tokens once, then cut it in the last call's arguments
    # (the parallel calls before it stay whole; tests/test_parsers.py cuts the second of two calls too).
    probe = client.chat.completions.create(**kw, max_tokens=100, logprobs=True)
    assert probe.choices[0].finish_reason == "tool_calls"  # the calls end (they once went on until max_tokens)
    tokens = [t.token for t in probe.choices[0].logprobs.content]
    text = "".join(tokens)
    heads = [m.end() for m in re.finditer(r'<tool_call>\s*\{"name": "\w+", "arguments": ', text)]
    assert heads and "</tool_call>" in text[heads[-1]:], text  # a whole last call to cut in
    middle = (heads[-1] + text.index("</tool_call>", heads[-1])) // 2
    cut = next(n for n in range(len(tokens)) if len("".join(tokens[:n])) > middle)
    args = "".join(tokens[:cut])[heads[-1]:]  # the last call's arguments up to the cut: unfinished JSON

    whole = client.chat.completions.create(**kw, max_tokens=cut)
    msg = whole.choices[0].message
    got_whole = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**kw, max_tokens=cut, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                name_args = calls.setdefault(tc.index, ["", ""])
                name_args[0] += tc.function.name or ""
                name_args[1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    got_stream = [tuple(calls[i]) for i in sorted(calls)]

    assert whole.usage.completion_tokens == cut and whole.choices[0].finish_reason == "length" and finish == "length"
    assert got_whole == got_stream and msg.content is None and content == ""
    assert len(got_whole) == len(heads) and got_whole[-1][1] == args and args.startswith("{")
    for _, whole_args in got_whole[:-1]:
        json.loads(whole_args)  # the calls before it are whole
    with pytest.raises(json.JSONDecodeError):
        json.loads(args)


def test_auto_tools_with_a_tool_calling_transcript(client, model):
    transcript = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    r = client.chat.completions.create(model=model, messages=transcript, tools=[WEATHER], max_tokens=60, temperature=0)
    msg = r.choices[0].message
    if msg.tool_calls:  # the model may call again; then the call parses and names a real tool
        assert r.choices[0].finish_reason == "tool_calls"
        assert all(c.function.name == "get_weather" and json.loads(c.function.arguments) for c in msg.tool_calls)
    else:
        assert msg.content and "<tool_call>" not in msg.content
    without = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens > without.usage.prompt_tokens  # the call and its result are in the prompt
    none = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=20, temperature=0)
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason in ("stop", "length")
    # an agent's closing turn: the transcript again, no tools offered (none sent, or "none"); the
    # call and its result are still in the prompt (they were a 400 inside the template, or dropped)
    call_dropped = [transcript[0], {"role": "assistant", "content": ""}, transcript[2]]
    for kw in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        last = client.chat.completions.create(model=model, messages=transcript, max_tokens=5, temperature=0, **kw)
        assert not last.choices[0].message.tool_calls
        dropped = client.chat.completions.create(model=model, messages=call_dropped, max_tokens=1, temperature=0, **kw)
        assert last.usage.prompt_tokens > dropped.usage.prompt_tokens, kw


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format"),
    ({"extra_body": {"regex": "a(b"}}, "regex"),
    ({"extra_body": {"ebnf": "root ::= missing"}}, "ebnf"),
    ({"extra_body": {"regex": "a", "ebnf": 'root ::= "a"'}}, "ebnf"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    # what the grammar would not enforce, or fail on only once the request runs (schema_limits.py)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "object"}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": []}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "minLength": -1}}}, "stream": True}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "allOf": [{"type": "object"}, {"required": ["a"]}]}}}]}, "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "required": ["city"]}}}}, "response_format"),  # a required name it does not define
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "^[a-z]{1,15000}$"}}}}, "response_format"),  # seconds to build: refused
    ({"extra_body": {"ebnf": "root ::= x\nx ::= x"}, "stream": True}, "ebnf"),  # no text: a 400, not an event
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}}}}, "response_format"),  # beside $ref
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "oneOf": [{"type": "integer"}, {"type": "number"}]}}}}, "response_format"),  # overlapping: an anyOf
]


@pytest.mark.parametrize("kw, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_grammars_and_tool_schemas_are_400(server, client, model, kw, param):
    """Each a 400 naming the field, before anything is generated (a stream too)."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **kw)
    error = info.value.body
    assert error["param"] == param and error["message"].startswith(param.split("[")[0]), error
    assert health(server[1]) == 200


def test_a_forced_call_of_a_tool_without_parameters_ends(client, model):
    """An empty arguments object: the grammar once let the model pad it with whitespace until
    max_tokens, and the arguments never parsed."""
    ping = {"type": "function", "function": {"name": "ping", "description": "Check the server",
                                             "parameters": {"type": "object", "properties": {}}}}
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Call the ping tool."}],
                                       tools=[ping], tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls", r
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {}


def test_everything_released_after_structured_requests(server, client, model):
    m = metrics(server[1])
    assert m["ketch_num_requests_running"] == 0 and m["ketch_kv_pages_used"] == 0
    out = client.chat.completions.create(model=model, messages=ASK, max_tokens=3, temperature=0)
    assert out.choices[0].message.content


# valid schemas once refused: draft 7 tuples, minProperties past the properties named, a dropped
# keyword in a definition nothing refers to
ONCE_REFUSED = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
     "minProperties": 2, "maxProperties": 2},
    {"type": "array", "items": [{"type": "string", "maxLength": 10}, {"type": "integer"}], "additionalItems": False},
    {"type": "object", "properties": {"city": {"$ref": "#/$defs/name"}}, "required": ["city"],
     "$defs": {"name": {"type": "string", "maxLength": 20}, "unused": {"not": {"type": "string"}}}},
]


@pytest.mark.parametrize("schema", ONCE_REFUSED, ids=range(len(ONCE_REFUSED)))
def test_valid_schemas_xgrammar_enforces_are_served(client, model, schema):
    import jsonschema as js

    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = client.chat.completions.create(model=model, messages=CITY, max_tokens=120, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].finish_reason == "stop", r
    validator = js.Draft7Validator if isinstance(schema.get("items"), list) else js.Draft202012Validator
    validator(schema).validate(json.loads(r.choices[0].message.content))
