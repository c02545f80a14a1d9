"""uvicorn's HTTP protocol with the two limits it lacks: a header deadline and a connection cap.

uvicorn closes idle keep-alive connections, but a connection that never sends a request, or sends
its headers a byte at a time, is held forever; so is any number of them. Here a connection gets
`header_timeout` seconds from its first byte (or from being opened) to complete a request's
headers, and beyond `max_connections` open ones a new connection is answered with a JSON 503 and
closed before it costs anything. (The body has its own deadline where routes read it: body.py;
a request answered before its body had all come closes its connection.)
"""
from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_BUSY_BODY = json.dumps({"error": {"message": "the server has too many open connections; retry later",
                                   "type": "service_unavailable", "param": None,
                                   "code": "too_many_connections"}}).encode()
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"content-length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class GuardedHttpProtocol(HttpToolsProtocol):
    header_timeout: float = 30.0
    max_connections: int | None = None

    @classmethod
    def with_limits(cls, header_timeout: float, max_connections: int | None) -> type["GuardedHttpProtocol"]:
        """A subclass carrying the limits (uvicorn builds protocols from a class)."""
        return type("GuardedHttpProtocol", (cls,), {"header_timeout": header_timeout,
                                                     "max_connections": max_connections})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
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

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # the next request on a kept-alive connection gets its own deadline

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # Answered before its body had all come (a 401, 404, 413, or the body's own deadline, 408):
        # the rest of that body would be read and dropped for as long as the client trickles it,
        # every byte postponing the keep-alive timeout, with no deadline left that covers it: a
        # client without the key could hold a --max-connections slot forever. Closed instead.
        if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
            self.transport.close()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
