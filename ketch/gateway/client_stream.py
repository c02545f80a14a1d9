"""How a relayed stream's events reach the client: written from the worker connection's callback.

Why: at 64 streams a relayed SSE event cost the gateway ~14 µs of CPU, half of it Python, and the
events of one engine step arrive together, so every event waits for the ones before it. Most of
that Python was the hand-over: the worker's bytes woke the relay task (a future, a task step, an
async generator, an ASGI message, uvicorn's `send` coroutine) before they were written. With a
`DirectClient` the upstream parser's body callback writes the client's chunk at once, on uvicorn's
own transport with uvicorn's chunked framing; the relay task sleeps until the answer ends or the
client's socket backs up (relay.py).

    client_stream(send) ─▶ DirectClient   `send` is uvicorn's httptools response cycle (the gateway
                                          serves with it, serve.py) and its response is chunked
                       ─▶ QueuedClient    any other ASGI server: the blocks wait for the relay
                                          task, which passes them to `send`

Both: `write(block)` from the callback (never blocks), `backed_up()` says the task must run before
more is read from the worker, `flush()` is the task's part (send what waits, wait for a drain).
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

Send = Callable[[dict], Awaitable[None]]


class ClientStream(Protocol):
    def write(self, block: bytes) -> None: ...

    def backed_up(self) -> bool: ...

    async def flush(self) -> None: ...


class DirectClient:
    """Chunks written on uvicorn's transport as its `send` would write them (response started,
    chunked); the end of the body still goes through `send`, which keeps uvicorn's state right."""

    __slots__ = ("cycle", "transport", "flow")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self.cycle, self.transport, self.flow = cycle, cycle.transport, cycle.flow

    def write(self, block: bytes) -> None:
        # gone or going: the relay task is being cancelled (generate.py); a write on a closed
        # transport would raise inside the worker connection's parser and look like its fault
        # (and an empty block would be a chunk of length 0: the end of the body)
        if block and not self.cycle.disconnected and not self.transport.is_closing():
            self.transport.write(b"%x\r\n%s\r\n" % (len(block), block))

    def backed_up(self) -> bool:
        return self.flow.write_paused and not self.cycle.disconnected

    async def flush(self) -> None:
        if self.backed_up():
            await self.flow.drain()


class QueuedClient:
    __slots__ = ("send", "blocks")

    def __init__(self, send: Send) -> None:
        self.send, self.blocks = send, []

    def write(self, block: bytes) -> None:
        self.blocks.append(block)

    def backed_up(self) -> bool:
        return bool(self.blocks)

    async def flush(self) -> None:
        while self.blocks:
            block = self.blocks.pop(0)
            await self.send({"type": "http.response.body", "body": block, "more_body": True})


def client_stream(send: Send) -> ClientStream:
    """Call after the response started (`http.response.start` sent)."""
    cycle: Any = getattr(send, "__self__", None)
    if isinstance(cycle, RequestResponseCycle) and cycle.chunked_encoding and not cycle.response_complete:
        return DirectClient(cycle)
    return QueuedClient(send)
