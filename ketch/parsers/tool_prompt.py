"""Tool use for models whose chat template knows nothing of tools (the bundled SmolLM2 is one).

Such a template ignores `tools`, cannot render an assistant turn that only calls tools (content
null), and has no place for tool results. `apply_tool_prompt` rewrites the conversation into what
any template renders: the tool list goes into the system message with instructions to answer in
the hermes format (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, read back by the
`hermes` parser), earlier calls become that text, and tool results become user turns wrapped in
`<tool_response>`.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ketch.text.chat_template import validate_messages

_TOOLS_VARIABLE = re.compile(r"\btools\b")
# OpenAI's rule for function names. Other characters broke calls: a quote or backslash pasted into
# a forced call's JSON made it unreadable, and the forced call came back as content.
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def template_supports_tools(template: str | None) -> bool:
    """Whether a jinja chat template renders the request's tools (it mentions `tools`)."""
    return bool(template) and _TOOLS_VARIABLE.search(template) is not None


def _object_schema(schema: Mapping[str, Any]) -> bool:
    """Whether a schema only admits objects: a call's arguments are an object (OpenAI's rule too);
    the parsers read nothing else back, so a forced call of any other type came back as content."""
    if "type" in schema:
        return schema["type"] == "object"
    return "properties" in schema  # no type: its keywords make it one (xgrammar reads it so too)


_TOOL_KEYS = ("type", "function")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def _known_keys(obj: Mapping, known: tuple[str, ...], where: str) -> None:
    unknown = [k for k in obj if k not in known]
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: not a field of this object (known: {', '.join(known)})")


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """The `function` objects of an OpenAI tools list; ValueError naming the bad field."""
    if not isinstance(tools, list):
        raise ValueError("tools: expected a list of {'type': 'function', 'function': {...}} objects")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type: only 'function' tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{where}.function: expected an object")
        _known_keys(tool, _TOOL_KEYS, where)  # a misspelt key was dropped silently, `parameters` with it
        _known_keys(fn, _FUNCTION_KEYS, f"{where}.function")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ValueError(f"{where}.function.strict: expected a boolean")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}.function.name: expected a non-empty string")
        if not _TOOL_NAME.fullmatch(fn["name"]):
            raise ValueError(f"{where}.function.name: {fn['name']!r} is not 1 to 64 letters, digits, '_' or '-'")
        if any(f["name"] == fn["name"] for f in functions):  # a call could not say which one it meant
            raise ValueError(f"{where}.function.name: {fn['name']!r} names an earlier tool too")
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description: expected a string")
        if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], Mapping):
            raise ValueError(f"{where}.function.parameters: expected a JSON Schema object")
        if fn.get("parameters") and not _object_schema(fn["parameters"]):
            kind = fn["parameters"].get("type")
            got = f"type {kind!r}" if "type" in fn["parameters"] else "no type and no properties"
            raise ValueError(f"{where}.function.parameters: must be an object schema ({{'type': 'object', ...}}), "
                             f"got {got}")
        functions.append(dict(fn))
    return functions


def render_tool_prompt(tools: Any, tool_choice: Any = "auto") -> str:
    """The system-prompt block that teaches a model the tools and the hermes call format."""
    functions = validate_tools(tools)
    listing = "\n".join(json.dumps({"type": "function", "function": fn}, ensure_ascii=False) for fn in functions)
    lines = [
        "# Tools",
        "",
        "You can call the functions described in JSON Schema inside <tools></tools> below.",
        "<tools>",
        listing,
        "</tools>",
        "",
        "To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> tags:",
        "<tool_call>",
        '{"name": <function-name>, "arguments": <arguments-json-object>}',
        "</tool_call>",
        (
            "Write one such block per call. A function's result comes back in a later message inside "
            "<tool_response></tool_response> tags."
        ),
    ]
    if tool_choice == "required":
        lines.append("You must call at least one function.")
    elif isinstance(tool_choice, Mapping) and isinstance(tool_choice.get("function"), Mapping):
        lines.append(f"You must call the function {tool_choice['function'].get('name')!s}.")
    return "\n".join(lines)


def _call_text(call: Any, where: str) -> str:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}.function.name: expected a string")
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):  # OpenAI sends arguments as JSON text; show the object itself
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    body = json.dumps({"name": fn["name"], "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def apply_tool_prompt(messages: Any, tools: Any, tool_choice: Any = "auto") -> list[dict[str, Any]]:
    """Copies of `messages` that a template without tool support renders: see the module doc.

    With no tools, the system prompt is left alone but earlier calls and results are still
    rewritten (the template could not render them either)."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(validate_messages(messages)):
        role = msg["role"]
        if role == "assistant" and msg.get("tool_calls"):
            calls = msg["tool_calls"]
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls: expected a list")
            parts = [msg["content"]] if msg["content"] else []
            parts += [_call_text(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            result = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # parallel results: one user turn, so roles still alternate
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append({k: v for k, v in msg.items() if k != "tool_calls"})
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if tools:
        block = render_tool_prompt(tools, tool_choice)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
