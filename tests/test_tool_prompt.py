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
from ketch.text import ChatTemplate, Tokenizer


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
    ],
)
def test_bad_tools_name_the_field(tools: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        validate_tools(tools)


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
