"""Tools for chat templates without tool support: detection, the system-prompt block, tool-list
validation, and a tool conversation rewritten into turns any template renders."""
from __future__ import annotations

import json
from typing import Any

import pytest
from parser_cases import TOOLS

from ketch.parsers import (
    ChatOutputParser,
    apply_tool_prompt,
    render_tool_prompt,
    template_supports_tools,
    validate_tools,
)
from ketch.text import ChatTemplate, Tokenizer, validate_messages


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load()


def test_template_supports_tools(tokenizer: Tokenizer) -> None:
    assert not template_supports_tools(tokenizer.chat_template)  # SmolLM2
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_supports_tools(None)


def test_tool_prompt_names_every_tool_and_the_format() -> None:
    block = render_tool_prompt(TOOLS, tool_choice="required")
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in block
    assert "<tool_call>" in block and "</tool_call>" in block and "must call" in block


@pytest.mark.parametrize(
    "tools, field",
    [
        ("x", "tools"),
        ([{"type": "retrieval"}], r"tools\[0\].type"),
        ([{"type": "function"}], r"tools\[0\].function"),
        ([{"type": "function", "function": {"name": ""}}], r"tools\[0\].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], r"tools\[0\].function.parameters"),
        ([{"type": "function", "function": {"name": "f"}}] * 2, r"tools\[1\].function.name: 'f' names an earlier"),
        # OpenAI's ^[a-zA-Z0-9_-]{1,64}$: a quote or backslash once broke a forced call's JSON
        *[([{"type": "function", "function": {"name": name}}], r"tools\[0\].function.name: .* is not 1 to 64")
          for name in ('get"weather', "get\\weather", "get\nweather", "get weather", "x" * 65, "get_weather\n", "é")],
        # a call's arguments are an object: the parsers read nothing else back
        *[([{"type": "function", "function": {"name": "f", "parameters": schema}}],
           r"tools\[0\].function.parameters: must be an object schema")
          for schema in ({"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": ["object", "null"]},
                         {"anyOf": [{"type": "object"}, {"type": "string"}]})],
    ],
)
def test_bad_tools_name_the_field(tools: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        validate_tools(tools)


@pytest.mark.parametrize("fn", [
    {"name": "x" * 64}, {"name": "Get-Weather_2"}, {"name": "f", "parameters": None}, {"name": "f", "parameters": {}},
    {"name": "f", "parameters": {"type": "object"}}, {"name": "f", "parameters": {"properties": {"a": {}}}},
])
def test_good_tools_pass(fn: dict[str, Any]) -> None:
    assert validate_tools([{"type": "function", "function": fn}]) == [fn]


def test_tool_conversation_renders_with_a_template_without_tools(tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:00"},
    ]
    adapted = apply_tool_prompt(messages, TOOLS)
    assert [m["role"] for m in adapted] == ["system", "user", "assistant", "user"]
    assert adapted[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n14:00\n</tool_response>"
    prompt = ChatTemplate(tokenizer.chat_template).render(adapted)
    assert "get_weather" in prompt and "<tool_response>" in prompt
    # The calls written into the history are exactly what the hermes parser reads back.
    back = ChatOutputParser.parse(adapted[2]["content"], tool_parser="hermes", tools=TOOLS)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in back["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    # An existing system prompt is kept, with the tools block after it.
    kept = apply_tool_prompt([{"role": "system", "content": "Be brief."}, *messages[:1]], TOOLS)
    assert kept[0]["content"].startswith("Be brief.\n\n# Tools")


def test_openai_history_shapes_are_accepted(tokenizer: Tokenizer) -> None:
    """An assistant turn with tool_calls may leave `content` out (OpenAI: content is required
    unless tool_calls is given), and an assistant turn may hold a refusal part, rendered as text."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't share that."}]},
        {"role": "user", "content": "Fine."},
    ]
    checked = validate_messages(messages)
    assert checked[1]["content"] is None and checked[3]["content"] == "I can't share that."
    adapted = apply_tool_prompt(messages, TOOLS)
    assert adapted[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                          '{"city": "Paris"}}\n</tool_call>'}
    prompt = ChatTemplate(tokenizer.chat_template).render(adapted)
    assert "I can't share that." in prompt and "<tool_response>\n18 C" in prompt
    # still refused: no content and no calls; a refusal part where no model wrote one
    with pytest.raises(ValueError, match=r"messages\[0\]\.content: missing"):
        validate_messages([{"role": "assistant", "tool_calls": []}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: only .* not 'refusal'"):
        validate_messages([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])
