"""A request body as the gateway reads it: bounded in size, a JSON object or a clear 4xx."""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from ketch.gateway.errors import GatewayError

Receive = Callable[[], Awaitable[dict]]


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole body from ASGI `receive` messages; 413 past `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"the request body is larger than {limit} bytes", "request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_object(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except ValueError as e:  # UnicodeDecodeError is one
        raise GatewayError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    except RecursionError:  # thousands of nested brackets: the workers refuse past 64 levels anyway
        raise GatewayError(400, "the request body is not valid JSON: nested too deeply", "invalid_json") from None
    if not isinstance(parsed, dict):
        raise GatewayError(400, f"the request body must be a JSON object, got {type(parsed).__name__}",
                           "invalid_json")
    return parsed
