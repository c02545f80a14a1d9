"""Relay one worker's answer to the client as it arrives, and end it cleanly whatever happens.

- Bytes go out as they come (no buffering of the answer); a stream goes out in whole SSE events:
  a read that ends inside an event keeps that tail until the event's blank line arrives, so a cut
  never leaves the client half an event (failover.py builds on that).
- The client leaving cancels the relay and closes the upstream response, so the worker sees the
  disconnect and aborts the generation; it is not the worker's fault.
- The worker failing mid-answer (connection lost, silent past the timeout, a stream closed before
  [DONE]) is charged to it; a stream then gets `Failover.resume`'s continuation, or an error event
  and [DONE].
- A resumable stream's chunks carry the token ids the gateway asked for (routed.py): the transcript
  keeps them, the client gets them only if it asked.
- The in-flight count is given back exactly once (Attempt.close in the `finally`).
"""
from __future__ import annotations

from contextlib import aclosing
from typing import Any, Awaitable, Callable

import anyio
import httpx2 as httpx
from starlette.responses import Response

from ketch.gateway.attempt import Attempt
from ketch.gateway.failover import Failover, StreamTranscript
from ketch.gateway.routed import RoutedRequest
from ketch.gateway.sse import event_boundary, lost_event, strip_token_ids

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]

# not forwarded: connection-level headers (RFC 9110 §7.6.1), and those uvicorn writes itself
_DROPPED = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                      "transfer-encoding", "upgrade", "date", "server"})
WORKER_HEADER = b"x-ketch-worker"


class _ClientGone(Exception):
    pass


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class Relay(Response):
    def __init__(self, upstream: httpx.Response, attempt: Attempt, request: RoutedRequest | None,
                 failover: Failover) -> None:
        # Response's own __init__ would render a body and set its length: this one is relayed
        self.upstream, self.attempt, self.request, self.failover = upstream, attempt, request, failover
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = [(k.lower(), v) for k, v in upstream.headers.raw if k.lower().decode() not in _DROPPED]
        self.raw_headers.append((WORKER_HEADER, attempt.worker.url.encode()))
        self.streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")
        # only a stream a failover could resume keeps its events (they are what it resumes from)
        self.transcript = StreamTranscript(keep_events=failover.keep_events and request is not None
                                           and request.fields is not None)
        self.strip_ids = request is not None and request.strip_ids

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_cancel_on_disconnect, receive, tasks.cancel_scope)
                try:  # caught here: out of a task group it would come wrapped in an ExceptionGroup
                    await _send(send, {"type": "http.response.start", "status": self.status_code,
                                       "headers": self.raw_headers})
                    await self._pump(send)
                except _ClientGone:
                    pass
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):  # also when cancelled: the worker must see the close
                await self.upstream.aclose()
            self.attempt.close()

    async def _pump(self, send: Send) -> None:
        pending = b""
        try:
            async for chunk in self.upstream.aiter_raw():
                if not self.streaming:
                    await _send(send, _body(chunk))
                    continue
                data = pending + chunk if pending else chunk
                cut = event_boundary(data)
                if cut:
                    await _send(send, _body(strip_token_ids(data[:cut]) if self.strip_ids else data[:cut]))
                    self.transcript.feed(data[:cut])
                pending = data[cut:]
        except httpx.TransportError as e:  # the worker, not the client: its reads failed
            self.attempt.failed("timeout" if isinstance(e, httpx.TimeoutException) else "stream_cut")
            if self.streaming and not self.transcript.done:
                await self._after_cut(send, _describe(e))
            await _send(send, _body(b"", more=False))
            return
        if self.streaming and not self.transcript.done:
            self.attempt.failed("stream_cut")
            await self._after_cut(send, "it closed the stream before [DONE]")
        elif pending:
            await _send(send, _body(pending))
        await _send(send, _body(b"", more=False))

    async def _after_cut(self, send: Send, reason: str) -> None:
        rest = None
        if self.request is not None:
            rest = await self.failover.resume(self.request, self.transcript, self.attempt.worker)
        if rest is None:
            await _send(send, _body(lost_event(self.attempt.worker.url, reason)))
            return
        async with aclosing(rest):  # closed now if the client leaves, so its worker sees it too
            async for block in rest:  # it keeps the transcript itself (ids and all)
                await _send(send, _body(block))


def _body(data: bytes, more: bool = True) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def _send(send: Send, message: dict) -> None:
    try:
        await send(message)
    except Exception as e:  # the client's connection is gone (or refused the bytes): stop relaying
        raise _ClientGone() from e


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
