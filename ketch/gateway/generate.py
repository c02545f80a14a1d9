"""The two generation routes (POST /v1/chat/completions, /v1/completions) as plain ASGI.

They carry nearly all of the gateway's traffic, one SSE event at a time, so they skip the web
framework: no middleware stack wrapping every `send`, no task group per response. The front door
(app.py) hands them over after the API key check; every other route goes through FastAPI.

    read the body (413 past the limit, 400 if not a JSON object) ─ route it (routed.py)
    ─ a watcher task waits for the client's disconnect ─ open a worker's answer (forward.py:
      policy, retries; pd.py: a prefill and a decode worker) ─ relay it (relay.py: failover for a
      cut stream) ─ the watcher goes

The client leaving, at any point after its body arrived, makes the watcher cancel the request's
task: a wait for a worker's answer is given up, a relay stops, and either way the worker's
connection is closed (in their `finally`), so the worker aborts the generation instead of
finishing it for nobody. Nothing of that is the worker's fault.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Protocol

from ketch.gateway.body import ClientGone, Receive, parse_object, read_body
from ketch.gateway.errors import GatewayError
from ketch.gateway.routed import CHAT, COMPLETIONS, ROUTE_PATHS, RoutedRequest, routed_request

GENERATION_ROUTES = {ROUTE_PATHS[CHAT]: CHAT, ROUTE_PATHS[COMPLETIONS]: COMPLETIONS}
Send = Callable[[dict], Awaitable[None]]


class Responder(Protocol):
    """Answers a routed generation request: forward.Forwarder (one worker), pd.PDForwarder (a pair)."""

    async def respond(self, request: RoutedRequest, scope: dict[str, Any], receive: Receive, send: Send) -> None: ...


class Generation:
    def __init__(self, forwarder: Callable[[], Responder], max_request_bytes: int, resumable: bool = True) -> None:
        # the forwarder exists once the gateway started (inside the server's event loop)
        self.forwarder, self.limit, self.resumable = forwarder, max_request_bytes, resumable

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send, route: str) -> None:
        try:
            body = await read_body(receive, self.limit)
            request = routed_request(route, body, parse_object(body), self.resumable)
        except ClientGone:
            return
        except GatewayError as e:
            await e.response()(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.forwarder().respond(request, scope, receive, send)
        except asyncio.CancelledError:
            if not gone:  # not ours: the server is stopping
                raise
            task.uncancel()
        finally:
            watcher.cancel()
