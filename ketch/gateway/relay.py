"""Relay one worker's answer to the client as it arrives, and end it cleanly whatever happens.

- Bytes go out as they come (no buffering of the answer); a stream goes out in whole SSE events:
  a read that ends inside an event keeps that tail until the event's blank line arrives, so a cut
  never leaves the client half an event (failover.py builds on that). A stream's events are
  written from the worker connection's callback (client_stream.py): no task wake-up per event.
- The client leaving cancels the task that relays (generate.py watches for it); the `finally`
  closes the worker's connection, so the worker sees the disconnect and aborts the generation. It
  is not the worker's fault.
- The worker failing mid-answer (connection lost, silent past the timeout, a stream closed before
  [DONE], its engine's death or its shutdown deadline reported in the stream) is charged to it;
  a stream then gets `Failover.resume`'s continuation, or an error event and [DONE].
- A resumable stream's chunks carry the token ids the gateway asked for (routed.py): the transcript
  keeps them, the client gets them only if it asked.
- The in-flight count is given back exactly once (Attempt.close in the `finally`).
"""
from __future__ import annotations

from contextlib import aclosing
from typing import Awaitable, Callable, Sequence

from starlette.responses import Response

from ketch.gateway.attempt import Attempt
from ketch.gateway.client_stream import ClientStream, client_stream
from ketch.gateway.failover import Failover, StreamTranscript
from ketch.gateway.routed import RoutedRequest
from ketch.gateway.sse import EventCutter, lost_event, strip_token_ids, worker_gone_at
from ketch.gateway.upstream import Answer, UpstreamError, UpstreamTimeout

Send = Callable[[dict], Awaitable[None]]

# not forwarded: connection-level headers (RFC 9110 §7.6.1), and those uvicorn writes itself
_DROPPED = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                      b"trailer", b"transfer-encoding", b"upgrade", b"date", b"server"})
WORKER_HEADER = b"x-ketch-worker"
GOING = "it said it is going (its engine died, or its shutdown deadline passed)"


def relayed_headers(answer: Answer, attempt: Attempt) -> list[tuple[bytes, bytes]]:
    headers = [(k, v) for k, v in answer.headers if k not in _DROPPED]
    headers.append((WORKER_HEADER, attempt.worker.url.encode()))
    return headers


def whole_response(answer: Answer, attempt: Attempt, body: bytes) -> Response:
    """An answer read whole (`body`), passed on with its status and headers."""
    response = Response(body, status_code=answer.status_code)
    response.raw_headers = [(b"content-length", str(len(body)).encode())] + [
        (k, v) for k, v in relayed_headers(answer, attempt) if k != b"content-length"]
    return response


async def relay(send: Send, attempt: Attempt, answer: Answer, request: RoutedRequest | None,
                failover: Failover, extra: Sequence[tuple[bytes, bytes]] = ()) -> bool:
    """Send `answer` (status, headers and `extra` ones, body) to the client; closes the answer and
    the attempt. True if the worker's answer (or its continuation) reached the client whole."""
    try:
        await send({"type": "http.response.start", "status": answer.status_code,
                    "headers": relayed_headers(answer, attempt) + list(extra)})
        if answer.content_type.startswith("text/event-stream"):
            return await _stream(send, attempt, answer, request, failover)
        return await _whole(send, attempt, answer)
    finally:
        answer.close()
        attempt.close()


async def _whole(send: Send, attempt: Attempt, answer: Answer) -> bool:
    whole = True
    try:
        async for chunk in answer.chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except UpstreamError as e:  # the client has part of a body: nothing to add but the end
        attempt.failed("timeout" if isinstance(e, UpstreamTimeout) else "stream_cut")
        whole = False
    await send(_END)
    return whole


class _Events:
    """The upstream body's taker for a stream: whole events go out to the client as they complete
    (the tail of a read that ends inside one waits for the rest) and into the transcript. The
    worker's `engine_unavailable` or `server_shutdown` event (its engine died, its shutdown deadline
    passed) and what follows it stay back: the stream is then a cut one (`worker_gone`), for the
    failover to go on with."""

    __slots__ = ("client", "transcript", "strip", "cutter", "worker_gone")

    def __init__(self, client: ClientStream, transcript: StreamTranscript, strip: bool) -> None:
        self.client, self.transcript, self.strip, self.cutter = client, transcript, strip, EventCutter()
        self.worker_gone = False

    def feed(self, data: bytes) -> None:
        if self.worker_gone:
            return
        block = self.cutter.feed(data)
        gone = worker_gone_at(block)
        if gone >= 0:
            self.worker_gone, block = True, block[:gone]
        if block:
            sent = strip_token_ids(block) if self.strip else block
            if sent:  # a block of held-back tokens' ids alone leaves nothing for the client
                self.client.write(sent)
            self.transcript.feed(block)


async def _stream(send: Send, attempt: Attempt, answer: Answer, request: RoutedRequest | None,
                  failover: Failover) -> bool:
    # only a stream a failover could resume keeps its events (they are what it resumes from)
    transcript = StreamTranscript(keep_events=failover.keep_events and request is not None
                                  and request.fields is not None)
    client = client_stream(send)
    events = _Events(client, transcript, strip=request is not None and request.strip_ids)
    try:
        # the events go out from the worker connection's callback (client_stream.py); this task
        # wakes only when the client must catch up, and at the end
        answer.pipe(events.feed, client.backed_up)
        while not await answer.piped():
            await client.flush()
            answer.resume()
        reason = GOING if events.worker_gone else None if transcript.done else "it closed the stream before [DONE]"
    except UpstreamError as e:  # the worker, not the client: its reads failed
        reason = GOING if events.worker_gone else None if transcript.done else str(e)
        kind = "timeout" if isinstance(e, UpstreamTimeout) else "stream_cut"
    else:
        kind = "stream_cut"
    await client.flush()  # what the queued client still holds goes before anything else
    if reason is not None:
        attempt.failed(kind)
        # the lost worker's socket and in-flight count go now, not when the continuation ends
        answer.close()
        attempt.close()
        await _after_cut(send, attempt, request, failover, transcript, reason)
    elif events.cutter.pending:  # bytes after [DONE] that never became an event: passed on as they came
        await send({"type": "http.response.body", "body": events.cutter.pending, "more_body": True})
    await send(_END)
    return transcript.done


async def _after_cut(send: Send, attempt: Attempt, request: RoutedRequest | None, failover: Failover,
                     transcript: StreamTranscript, reason: str) -> None:
    rest = None
    if request is not None:
        rest = await failover.resume(request, transcript, attempt.worker)
    if rest is None:
        await send({"type": "http.response.body", "body": lost_event(attempt.worker.url, reason), "more_body": True})
        return
    async with aclosing(rest):  # closed now if the client leaves, so its worker sees it too
        async for block in rest:  # it keeps the transcript itself (ids and all)
            await send({"type": "http.response.body", "body": block, "more_body": True})


_END = {"type": "http.response.body", "body": b"", "more_body": False}
