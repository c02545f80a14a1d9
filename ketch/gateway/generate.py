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

The shutdown deadline (`cut_open`, serve.py) cancels every open request the same way, and each
then gets an answer a client can tell from a cut connection: a `server_shutdown` error event and
[DONE] on a stream, a 503 if nothing was sent yet (as `ketch serve` ends its own at its deadline).
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Protocol

from ketch.gateway.body import ClientGone, Receive, parse_object, read_body
from ketch.gateway.errors import GatewayError, unavailable
from ketch.gateway.routed import CHAT, COMPLETIONS, ROUTE_PATHS, RoutedRequest, routed_request
from ketch.gateway.sse import DONE, event
from ketch.request_id import SCOPE_KEY

GENERATION_ROUTES = {ROUTE_PATHS[CHAT]: CHAT, ROUTE_PATHS[COMPLETIONS]: COMPLETIONS}
Send = Callable[[dict], Awaitable[None]]


class Responder(Protocol):
    """Answers a routed generation request: forward.Forwarder (one worker), pd.PDForwarder (a pair)."""

    async def respond(self, request: RoutedRequest, scope: dict[str, Any], receive: Receive, send: Send) -> None: ...


class Generation:
    def __init__(self, forwarder: Callable[[], Responder], max_request_bytes: int, resumable: bool = True) -> None:
        # the forwarder exists once the gateway started (inside the server's event loop)
        self.forwarder, self.limit, self.resumable = forwarder, max_request_bytes, resumable
        self.open: set[asyncio.Task] = set()  # the requests being answered
        self.shut = False  # the shutdown deadline passed: what is still open is cut

    def cut_open(self) -> None:
        """The shutdown deadline: every request still open ends now, with a `server_shutdown` answer."""
        self.shut = True
        for task in self.open:
            task.cancel()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send, route: str) -> None:
        try:
            body = await read_body(receive, self.limit)
            request = routed_request(route, body, parse_object(body), self.resumable, scope.get(SCOPE_KEY))
        except ClientGone:
            return
        except GatewayError as e:
            await e.response()(scope, receive, send)
            return
        if self.shut:  # its body was still coming in at the deadline
            await SHUTDOWN.response()(scope, receive, send)
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
        self.open.add(task)
        try:
            await self.forwarder().respond(request, scope, receive, send)
        except asyncio.CancelledError:
            if not (gone or self.shut):  # not ours: uvicorn's own deadline, past ours
                raise
            task.uncancel()
            if not gone:
                await shutdown_answer(request, scope, receive, send)
        finally:
            self.open.discard(task)
            watcher.cancel()


SHUTDOWN = unavailable("the gateway is shutting down; the request was cut at the shutdown deadline", "server_shutdown")


async def shutdown_answer(request: RoutedRequest, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """The end of a request cut at the shutdown deadline; its worker connection is closed already."""
    cycle = getattr(send, "__self__", None)  # uvicorn's response cycle knows whether it started
    if not getattr(cycle, "response_started", True):
        await SHUTDOWN.response()(scope, receive, send)
        return
    if request.stream:  # events went out whole (relay.py): one more, then [DONE]
        await send({"type": "http.response.body", "body": event(SHUTDOWN.body()) + DONE + b"\n\n",
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    # part of a JSON body went out: nothing can be added to it; left incomplete, the connection is
    # closed (uvicorn), so the client cannot take the part for the whole
