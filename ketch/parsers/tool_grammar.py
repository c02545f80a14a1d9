"""Grammars (xgrammar structural tags, as plain JSON-able dicts) that make a model's output parse.

- `forced_calls`: for tool_choice "required" or a named function, the output is one or more
  calls in the tool parser's own format, each call's arguments constrained by its JSON Schema,
  so the parser always reads valid calls back.
- `after_reasoning`: a grammar for the answer that lets the reasoning (`<think>…</think>`) run
  free first; the constraint applies to what follows it.

Formats are described here as (begin, between name and arguments, end, separator, layout); they
must agree with the parsers beside this file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CallFormat:
    begin: str  # before the function name
    infix: str  # between the name and the arguments object
    end: str  # after the arguments object
    separator: str  # between two calls
    prefix: str = ""  # once before all calls
    suffix: str = ""  # once after all calls
    # Whitespace a model trained on the format may write after any call, the last one too (the
    # parsers drop it as layout). It belongs to the call, never to the separator: a separator that
    # begins with a newline made the newline after the last `</tool_call>` a promise of another call.
    layout: str = ""
    json_name: bool = False  # the name sits inside a JSON string: it is written JSON-escaped


CALL_FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "", layout="\n",
                         json_name=True),
    # No such trap: a model writes the `;` that begins this separator only to start another call.
    "llama3": CallFormat('{"name": "', '", "parameters": ', "}", "; ", json_name=True),
    "mistral": CallFormat("[TOOL_CALLS]", "[ARGS]", "", ""),
    "deepseek-v3": CallFormat("<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "\n```json\n", "\n```<｜tool▁call▁end｜>",
                              "", prefix="<｜tool▁calls▁begin｜>", suffix="<｜tool▁calls▁end｜>", layout="\n"),
}


# At most one whitespace character in a row inside constrained JSON: the grammar otherwise lets a
# model pad an object with whitespace until max_tokens (seen with a tool of no parameters:
# `{\n    \n      ...`, arguments that never parse). response_format's JSON has the same bound
# through xgrammar's any_whitespace=False; this is the structural tag's spelling of it.
MAX_WHITESPACE = 1


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def _json(schema: dict[str, Any] | bool) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def _name(fmt: CallFormat, name: str) -> str:
    # validate_tools admits only names that need no escaping; this keeps the JSON valid regardless.
    return json.dumps(name, ensure_ascii=False)[1:-1] if fmt.json_name else name


def forced_calls(tool_parser: str, functions: list[dict[str, Any]], parallel: bool,
                 layout: bool = True) -> dict[str, Any]:
    """A structural tag: only calls of `functions` (at least one; one when not `parallel`).

    layout=False: no whitespace after a call, so calls come back to back, then the end. For a model
    that learned the format only from ketch's tool prompt: it writes a newline after
    `</tool_call>` out of habit, and once that is written it goes on with another call rather than
    end its turn (SmolLM2: `<` over the stop token after the newline), until max_tokens."""
    fmt = CALL_FORMATS[tool_parser]
    end: str | list[str] = [fmt.end, fmt.end + fmt.layout] if fmt.layout and layout else fmt.end
    tags = [{"type": "tag", "begin": fmt.begin + _name(fmt, fn["name"]) + fmt.infix,
             "content": _json(_parameters(fn)), "end": end}
            for fn in functions]
    calls: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
                             "at_least_one": True, "stop_after_first": not parallel}
    if fmt.prefix or fmt.suffix:
        calls = {"type": "sequence", "elements": [
            {"type": "const_string", "value": fmt.prefix}, calls, {"type": "const_string", "value": fmt.suffix}]}
    return calls


def answer_format(kind: str, source: str) -> dict[str, Any]:
    """A structural-tag format for a response_format / regex / EBNF grammar."""
    if kind == "json_object":
        return _json({"type": "object"})
    if kind == "json_schema":
        return _json(json.loads(source))
    if kind == "regex":
        return {"type": "regex", "pattern": source}
    if kind == "ebnf":
        return {"type": "grammar", "grammar": source}
    raise ValueError(f"grammar: cannot compose a {kind!r} grammar")


def after_reasoning(answer: dict[str, Any], opens_think: bool) -> dict[str, Any]:
    """Free reasoning up to `</think>`, then `answer`. `opens_think`: the output starts with
    `<think>` itself (else the chat template opened the block and the output starts inside it)."""
    think = {"type": "tag", "begin": "<think>" if opens_think else "", "content": {"type": "any_text"},
             "end": "</think>"}
    return {"type": "sequence", "elements": [think, answer]}


def structural_tag(fmt: dict[str, Any]) -> str:
    """The JSON text a GrammarSpec('structural_tag', ...) carries."""
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False, separators=(",", ":"))
