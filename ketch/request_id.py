"""The request id of an HTTP request, shared by `ketch serve` and `ketch gateway`.

A client may name its request with an `x-request-id` header (1-128 visible ASCII characters, as
load balancers and tracing proxies send); otherwise the server makes one. The id comes back on
the answer's `x-request-id` header and names the request in the server's log lines. The gateway
passes the id on to the worker(s) it forwards the request to (both workers of a PD pair, the
worker a broken stream resumes on), so the client, the gateway and every worker name one request
alike. It is for correlation only: the OpenAI response ids stay the server's own (a client may
reuse an id; the engine's request ids must not repeat).
"""
from __future__ import annotations

import os
from typing import Any, Awaitable, Callable, Iterable

HEADER = b"x-request-id"
MAX_LEN = 128
SCOPE_KEY = "ketch.request_id"  # where the ASGI front doors keep it for the routes

Send = Callable[[dict], Awaitable[None]]


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's id when its x-request-id header is usable, else a new random one; an unusable
    header (empty, too long, spaces or control bytes) is ignored rather than refused."""
    for name, value in headers:
        if name == HEADER:
            if 0 < len(value) <= MAX_LEN and all(0x21 <= c <= 0x7E for c in value):
                return value.decode("ascii")
            break
    return os.urandom(8).hex()


class SendWithId:
    """`send` whose response start carries x-request-id: rid (any other x-request-id, such as a
    relayed worker's echo, dropped) and the `extra` headers.

    It keeps the wrapped bound method's `__self__` (uvicorn's response cycle): the gateway's
    relay writes a stream's chunks on that cycle's transport itself (gateway/client_stream.py)
    and reads whether its response started, once the start went out through here."""

    def __init__(self, send: Send, rid: str, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.send, self.header, self.extra = send, (HEADER, rid.encode()), extra
        self.__self__ = getattr(send, "__self__", None)

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
            message["headers"] = [*kept, self.header, *self.extra]
        await self.send(message)
