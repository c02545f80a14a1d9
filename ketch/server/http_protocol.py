"""uvicorn's HTTP protocol with the limits it lacks: a header deadline, a header size cap and a
connection cap.

uvicorn closes idle keep-alive connections, but a connection that never sends a request, or sends
its headers a byte at a time, is held forever; so is any number of them. Here a connection gets
`header_timeout` seconds from its first byte (or from being opened) to complete a request's
headers, a request's line and headers may take `max_header_bytes` bytes (more: a JSON 431, and the
connection closed), and beyond `max_connections` open ones a new connection is answered with a
JSON 503 and closed before it costs anything. (The body has its own deadline where routes read it:
body.py; a request answered before its body had all come closes its connection, and says so.)
"""
from __future__ import annotations

import asyncio
import json

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEADER_BYTES = 64 * 1024  # a request's line and headers, CRLFs included


def _answer(status: bytes, message: str, type: str, code: str) -> bytes:
    """A whole JSON error answer that closes its connection (written before any request cycle exists)."""
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


_BUSY = _answer(b"503 Service Unavailable", "the server has too many open connections; retry later",
                "service_unavailable", "too_many_connections")


class GuardedHttpProtocol(HttpToolsProtocol):
    header_timeout: float = 30.0
    max_connections: int | None = None
    max_header_bytes: int = MAX_HEADER_BYTES

    @classmethod
    def with_limits(cls, header_timeout: float, max_connections: int | None,
                    max_header_bytes: int = MAX_HEADER_BYTES) -> type["GuardedHttpProtocol"]:
        """A subclass carrying the limits (uvicorn builds protocols from a class)."""
        return type("GuardedHttpProtocol", (cls,), {"header_timeout": header_timeout,
                                                     "max_connections": max_connections,
                                                     "max_header_bytes": max_header_bytes})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_head = True  # from a message's end (or the connection's start) to its headers' end
        self._head_bytes = 0  # bytes received in that span
        if self.max_connections is not None and len(self.connections) >= self.max_connections:
            self.transport = transport  # connection_lost still runs; it must find these
            transport.write(_BUSY)
            transport.close()
            return
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        # Counted as the bytes come, not once the parser is done: httptools keeps a header line
        # that has not ended in memory, and --header-timeout alone lets a client send a great deal.
        # A read that goes past the cap may still hold the head's end and then its body: the parser
        # gets the part within the cap first, and the rest only if the head ended in it.
        if not self._in_head:
            super().data_received(data)
            return
        room = self.max_header_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        self._head_bytes = self.max_header_bytes
        super().data_received(data[:room])
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            return  # answered 400 by uvicorn, or taken over by a websocket
        if self._in_head and self._head_bytes >= self.max_header_bytes:
            self._headers_too_large()
        else:  # the head ended within the cap (and a pipelined one may have begun: counted afresh)
            self.data_received(data[room:])

    def _headers_too_large(self) -> None:
        # Not while an earlier (pipelined) request's answer is being written: it would be cut in two.
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(_answer(
                b"431 Request Header Fields Too Large",
                f"the request line and headers are larger than {self.max_header_bytes} bytes",
                "invalid_request_error", "request_headers_too_large"))
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # the next request on a kept-alive connection gets its own deadline

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_head = False
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:
            return  # an upgrade: no request cycle
        send = cycle.send

        async def send_closing_early(message: ASGISendEvent) -> None:
            # Answered before its body had all come (a 401, 404, 413, or the body's own deadline, 408):
            # the rest of that body would be read and dropped for as long as the client trickles it,
            # every byte postponing the keep-alive timeout, with no deadline left that covers it: a
            # client without the key could hold a --max-connections slot forever. Closed instead, and
            # said so: without keep-alive uvicorn writes `connection: close` and closes after the body.
            if message["type"] == "http.response.start" and cycle.more_body:
                cycle.keep_alive = False
            await send(message)

        cycle.send = send_closing_early  # type: ignore[method-assign]  # (its task has not run yet)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0  # what comes next is the next request's head

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
