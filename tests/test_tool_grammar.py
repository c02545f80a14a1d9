"""ketch/parsers/tool_grammar.py with xgrammar itself, no model: what a forced-call grammar lets a
model write after a complete call (as plan_chat builds it for a template with tools and for ketch's
tool prompt), and names that need JSON escaping. The text is fed byte by byte to a matcher over a
vocabulary of the 256 bytes and a stop token, as the model's tokens would be."""
from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr

from ketch.parsers import ChatOutputParser
from ketch.parsers.tool_grammar import CALL_FORMATS, CallFormat, forced_calls, structural_tag
from ketch.server.tools import plan_chat

STOP = 256
WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"<stop>"], xgr.VocabType.RAW,
                             stop_token_ids=[STOP])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def matcher(compiler: xgr.GrammarCompiler, grammar: dict[str, Any]) -> xgr.GrammarMatcher:
    compiled = compiler.compile_grammar(xgr.Grammar.from_structural_tag(structural_tag(grammar)))
    return xgr.GrammarMatcher(compiled)


def accepts(m: xgr.GrammarMatcher, text: str) -> bool:
    return all(m.accept_token(b) for b in text.encode())


def call(fmt: CallFormat, name: str, arguments: str) -> str:
    return f"{fmt.begin}{name}{fmt.infix}{arguments}{fmt.end}"


@pytest.mark.parametrize("parallel", [True, False])
def test_a_newline_after_a_hermes_call_still_lets_the_output_end(compiler, parallel):
    """The model writes "\\n" after `</tool_call>` out of habit: that must not commit it to another
    call (it once did, and `required` calls repeated until max_tokens)."""
    fmt = CALL_FORMATS["hermes"]
    text = call(fmt, "get_weather", '{"city": "Paris"}') + "\n"
    m = matcher(compiler, forced_calls("hermes", [WEATHER], parallel))
    assert accepts(m, text)
    assert m.accept_token(STOP) and m.is_terminated()
    # parallel calls still work after that newline, and only then
    two = text + call(fmt, "get_weather", '{"city": "Berlin"}')
    again = matcher(compiler, forced_calls("hermes", [WEATHER], parallel))
    assert (accepts(again, two) and again.accept_token(STOP)) == parallel
    msg = ChatOutputParser.parse(text, tool_parser="hermes", tools=[{"type": "function", "function": WEATHER}])
    assert msg["content"] is None and [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("parallel", [True, False])
def test_after_a_call_taught_by_the_tool_prompt_the_model_ends_or_calls_again(compiler, parallel):
    """A template without tools (SmolLM2): the model learned the format from ketch's prompt, writes
    "\n" after `</tool_call>` out of habit, and then chose `<` over the stop token (another call,
    then another, until max_tokens). There no whitespace may follow a call: the model ends, or
    (parallel) starts the next call right away."""
    fields = {"messages": [{"role": "user", "content": "Weather in Paris?"}],
              "tools": [{"type": "function", "function": WEATHER}], "tool_choice": "required",
              "parallel_tool_calls": parallel}
    fmt = CALL_FORMATS["hermes"]
    first, second = (call(fmt, "get_weather", f'{{"city": "{c}"}}') for c in ("Paris", "Berlin"))
    taught = plan_chat(fields, None, None, None).forced_grammar
    m = matcher(compiler, taught)
    assert accepts(m, first) and not m.accept_token(ord("\n")) and m.accept_token(STOP)
    m = matcher(compiler, taught)
    assert (accepts(m, first + second) and m.accept_token(STOP)) == parallel
    # a template that renders tools: its model was trained on the format's layout, which stays allowed
    trained = plan_chat(fields, "{{ tools }}", "hermes", None).forced_grammar
    m = matcher(compiler, trained)
    assert accepts(m, first + "\n") and m.accept_token(STOP)


@pytest.mark.parametrize("parser", sorted(CALL_FORMATS))
@pytest.mark.parametrize("blank", ["\n", " ", "\t", "\r\n"])
def test_whitespace_after_any_call_never_commits_to_another(compiler, parser, blank):
    """Every format: whitespace after a complete call is either refused by the grammar (the model
    cannot write it) or leaves the end of the output open."""
    fmt = CALL_FORMATS[parser]
    m = matcher(compiler, forced_calls(parser, [WEATHER], parallel=True))
    assert accepts(m, fmt.prefix + call(fmt, "get_weather", '{"city": "Paris"}'))
    if accepts(m, blank):
        assert accepts(m, fmt.suffix) and m.accept_token(STOP), repr(blank)


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_a_name_is_json_escaped_where_it_sits_in_json(compiler, parser):
    """validate_tools refuses such names; the grammar still writes JSON the parser reads back."""
    fn = {"name": 'say "hi"\\', "parameters": {"type": "object", "properties": {}}}
    fmt = CALL_FORMATS[parser]
    text = call(fmt, json.dumps(fn["name"])[1:-1], "{}")
    assert accepts(matcher(compiler, forced_calls(parser, [fn], parallel=False)), text)
    msg = ChatOutputParser.parse(text, tool_parser=parser, tools=[{"type": "function", "function": fn}])
    assert [c["function"]["name"] for c in msg["tool_calls"]] == [fn["name"]]
