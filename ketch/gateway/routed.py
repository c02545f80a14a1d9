"""A generation request as the policies see it: which route, whether it streams, and the text
the cache-aware policy matches against its trees.

The text approximates the prompt the worker will build, in the same order, so that requests that
share a prompt prefix share a text prefix: chat -> the tools (they go first, into the system
prompt), then each message as role and content; completions -> the prompt. It is never the exact
prompt (the gateway has no tokenizer or template); the body itself is forwarded untouched, and a
malformed one routes with whatever text can be read from it (the worker answers the 400).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CHAT, COMPLETIONS = "chat", "completions"
ROUTE_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}


@dataclass(frozen=True)
class RoutedRequest:
    route: str  # CHAT | COMPLETIONS
    text: str
    stream: bool
    body: bytes  # what the client sent, forwarded as is

    @property
    def path(self) -> str:
        return ROUTE_PATHS[self.route]


def routed_request(route: str, body: bytes, parsed: dict[str, Any]) -> RoutedRequest:
    text = chat_text(parsed) if route == CHAT else prompt_text(parsed.get("prompt"))
    return RoutedRequest(route=route, text=text, stream=parsed.get("stream") is True, body=body)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones, in order
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
    return ""


def chat_text(body: dict[str, Any]) -> str:
    pieces = []
    tools = body.get("tools")
    if tools:
        pieces.append(json.dumps(tools, sort_keys=True, ensure_ascii=False) + "\n")
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        if isinstance(m, dict):
            pieces.append(f"{m.get('role', '')}\n{_content_text(m.get('content'))}\n")
    return "".join(pieces)


def prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):  # token ids: their decimal spelling keeps the prefix relation
            return " ".join(str(t) for t in prompt)
        return prompt_text(first)  # a batch: routed by its first prompt (it all goes to one worker)
    return ""
