"""A generation request as the policies see it: which route, whether it streams, and the text
the cache-aware policy matches against its trees.

The text approximates the prompt the worker will build, in the same order, so that requests that
share a prompt prefix share a text prefix: chat -> the tools (they go first, into the system
prompt), then each message as role and content; completions -> the prompt. It is never the exact
prompt (the gateway has no tokenizer or template); a malformed body routes with whatever text can
be read from it (the worker answers the 400).

The body is forwarded untouched, except for a stream that can be resumed on another worker if its
worker dies (n = 1, one prompt; resume.py): the gateway asks for `return_token_ids` and, when the
client gave no seed, adds a random one (sampling then draws the same on every worker; an unseeded
request is one with a seed nobody chose).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

CHAT, COMPLETIONS = "chat", "completions"
ROUTE_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}


@dataclass(frozen=True)
class RoutedRequest:
    route: str  # CHAT | COMPLETIONS
    text: str
    stream: bool
    body: bytes  # what a worker gets
    # a resumable stream's body as sent (resume.continuation builds on it); None: not resumable
    fields: dict[str, Any] | None = field(default=None, compare=False)
    strip_ids: bool = False  # token_ids were asked for by the gateway, not by the client
    request_id: str | None = field(default=None, compare=False)  # x-request-id for the worker(s): request_id.py

    @property
    def path(self) -> str:
        return ROUTE_PATHS[self.route]


def routed_request(route: str, body: bytes, parsed: dict[str, Any], resumable: bool = True,
                   request_id: str | None = None) -> RoutedRequest:
    """`resumable=False` (PD mode: no failover) forwards every body untouched."""
    text = chat_text(parsed) if route == CHAT else prompt_text(parsed.get("prompt"))
    stream = parsed.get("stream") is True
    if not (resumable and stream and _one_sample(route, parsed)):
        return RoutedRequest(route=route, text=text, stream=stream, body=body, request_id=request_id)
    fields = {**parsed, "return_token_ids": True}
    if fields.get("seed") is None:
        fields["seed"] = random.getrandbits(63)
    try:
        resumable_body = json.dumps(fields, allow_nan=False).encode()
    except ValueError:  # a number past a float's range (1e400) parsed as inf, which JSON cannot spell:
        # re-encoded it would be `Infinity`, not JSON; sent as it came, the worker's 400 names the field
        return RoutedRequest(route=route, text=text, stream=stream, body=body, request_id=request_id)
    return RoutedRequest(route=route, text=text, stream=True, body=resumable_body, fields=fields,
                         strip_ids=parsed.get("return_token_ids") is not True, request_id=request_id)


def _one_sample(route: str, parsed: dict[str, Any]) -> bool:
    """One prompt, n = 1, not a resume already: what a worker can resume (server README)."""
    n = parsed.get("n")
    if (n is not None and (type(n) is not int or n != 1)) or "resume" in parsed \
            or type(parsed.get("return_token_ids", False)) is not bool:  # a bad one stays for the worker's 400
        return False
    if route == CHAT:
        return True
    prompt = parsed.get("prompt")
    return isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) >= 1 and (
        all(type(t) is int for t in prompt) or len(prompt) == 1))


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
