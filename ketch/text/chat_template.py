"""Render a model's Jinja chat template, the way transformers' apply_chat_template does.

Same environment as transformers (sandboxed, trim_blocks + lstrip_blocks, loop controls, a
non-escaping `tojson`, `raise_exception`, `strftime_now`) so prompts match token for token, but
with messages validated first, so a malformed request becomes a ValueError naming the field.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; a no-op here."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    # Templates raise to reject a conversation (e.g. roles that do not alternate): a client error.
    raise ValueError(f"messages: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False, separators: Any = None
) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' which would corrupt tool schemas in prompts.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _part_text(part: Any, role: str) -> str | None:
    """A content part's text, or None when it is not a part ketch can render."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    # OpenAI's assistant turns may hold the model's earlier refusal; its text is what was said.
    if kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    return None


def _flatten_content(content: Any, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content: expected a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        text = _part_text(part, role)
        if text is None:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            accepted = "{'type': 'text', 'text': ...}"
            if role == "assistant":
                accepted += " and {'type': 'refusal', 'refusal': ...}"
            raise ValueError(f"{where}.content[{j}]: only {accepted} parts work, not {kind!r}")
        texts.append(text)
    return "\n".join(texts)


ROLES = ("system", "developer", "user", "assistant", "tool")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Copies of the messages with list content flattened to a string; ValueError on bad input."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role', 'content'} objects")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: expected an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}")
        if role == "developer":  # OpenAI's newer name for the system role; templates know "system"
            msg = {**msg, "role": "system"}
        # An assistant turn that only calls tools has content null, or no content at all: OpenAI
        # requires content "unless tool_calls is given", and agent frameworks send it so.
        calls_only = role == "assistant" and bool(msg.get("tool_calls"))
        if "content" not in msg and not calls_only:
            raise ValueError(f"{where}.content: missing")
        content = msg.get("content")
        if content is None and not calls_only:
            raise ValueError(f"{where}.content: null is only allowed for assistant messages with tool_calls")
        if isinstance(content, list) and not content and not calls_only:  # OpenAI refuses it too
            raise ValueError(f"{where}.content: an empty list (expected at least one text part)")
        if msg.get("name") is not None and not isinstance(msg["name"], str):  # templates print it as a string
            raise ValueError(f"{where}.name: expected a string, got {type(msg['name']).__name__}")
        out.append({**msg, "content": None if content is None else _flatten_content(content, where, role)})
    return out


class ChatTemplate:
    """A compiled chat template; compile once per model, render per request."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat_template: syntax error on line {e.lineno}: {e.message}") from None

    def render(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        variables = {"bos_token": "", "eos_token": "", "tools": None, **kwargs}
        try:
            return self._template.render(
                messages=validate_messages(messages), add_generation_prompt=add_generation_prompt, **variables
            )
        except (jinja2.TemplateError, TypeError) as e:  # e.g. `+` on a missing/None field
            raise ValueError(f"chat_template: rendering failed: {e}") from None


def render_chat(template: str, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Render `messages` with `template`; kwargs (bos_token, eos_token, tools, ...) reach the template."""
    return ChatTemplate(template).render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
