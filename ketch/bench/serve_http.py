"""A small HTTP/1.1 client for `ketch bench serve`, built so a streamed token costs the client little.

Keep-alive connections on asyncio protocols; responses parsed by httptools (chunked, content-length
or close-delimited bodies). A streamed body is split into server-sent-event lines inside the read
callback and each `data:` payload goes to the caller's `on_data(payload, arrived)` there and then:
no coroutine wakes per event, and `arrived` is read once per socket read (the events of one read
arrived together). The request's coroutine wakes once, when the response ends.

It replaces httpx, whose per-event path (h11 events, decoders, a line iterator, a task switch per
line) held the benchmark at ~28 k tokens/s per process on a 16-core Xeon, a tenth of what this one
streams; docs/performance.md, "bench serve: the client's own ceiling".
"""
from __future__ import annotations

import asyncio
import ssl
import time
from typing import Callable
from urllib.parse import urlsplit

import httptools

# payload of one `data:` line (stripped), the perf_counter of the read that brought it; True: hand no more
OnData = Callable[[bytes, float], bool]


class HTTPError(Exception):
    """The exchange failed below HTTP status codes: connection lost, bad framing."""


class _Exchange:
    """One request and its response, fed by the connection's callbacks."""

    __slots__ = ("on_data", "status", "body", "tail", "done", "got_bytes", "framed", "stopped")

    def __init__(self, on_data: OnData | None, done: asyncio.Future) -> None:
        self.on_data = on_data
        self.status = 0
        self.body: list[bytes] = []
        self.tail = b""  # an event line not yet ended by its newline
        self.done = done
        self.got_bytes = False
        self.framed = False  # content-length or chunked: the body's end is in the bytes, not the close
        self.stopped = False  # on_data asked to stop: nothing more is handed to it

    def feed_events(self, data: bytes, now: float) -> None:
        if b"\r" in data:  # SSE allows CRLF and bare CR line ends; make them LF (an extra blank line is harmless)
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = (self.tail + data).split(b"\n") if self.tail else data.split(b"\n")
        self.tail = lines.pop()
        on_data = self.on_data
        for line in lines:
            if line[:5] == b"data:" and on_data(line[5:].strip(), now):
                self.stopped = True
                return

    def finish(self, result: object = None, error: Exception | None = None) -> None:
        if self.done.done():
            return
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result(result)


class _Connection(asyncio.Protocol):
    def __init__(self, client: HTTPClient) -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.closed = False
        self.reusable = True  # False once a response was abandoned midway: its rest would be read as the next one's
        self._now = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, exchange: _Exchange, request: bytes) -> None:
        self.exchange = exchange
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # bytes nobody asked for: the connection cannot be trusted
            self.transport.close()
            return
        self._now = time.perf_counter()
        ex.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            ex.finish(error=HTTPError(f"bad HTTP response: {e}"))
            self.exchange = None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client.open.discard(self)
        ex, self.exchange = self.exchange, None
        if ex is None:
            return
        if ex.status and not ex.framed:  # a close-delimited body ends with the connection
            self._end(ex)
        else:
            ex.finish(error=HTTPError(f"connection closed before the response ended ({exc or 'by the server'})"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.exchange.framed = True

    def on_headers_complete(self) -> None:
        self.exchange.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        ex = self.exchange
        if ex.stopped:
            return
        if ex.on_data is not None and ex.status == 200:
            ex.feed_events(body, self._now)
        else:
            ex.body.append(body)

    def on_message_complete(self) -> None:
        ex, self.exchange = self.exchange, None
        keep = self.parser.should_keep_alive()
        self._end(ex)
        if keep and self.reusable and not self.closed:
            self.client.idle.append(self)
        else:
            self.transport.close()

    def _end(self, ex: _Exchange) -> None:
        if ex.on_data is not None and ex.status == 200 and ex.tail and not ex.stopped:
            ex.feed_events(b"\n", self._now)  # a last line without its newline
        ex.finish((ex.status, b"".join(ex.body)))


class HTTPClient:
    """Requests against one server root, over keep-alive connections (one per request in flight)."""

    def __init__(self, base_url: str, connect_timeout_s: float = 30.0) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"base_url: must be http(s)://host[:port][/path], got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None
        self.prefix = u.path.rstrip("/")
        self.host_header = u.netloc.rsplit("@", 1)[-1]
        self.connect_timeout_s = connect_timeout_s
        self.idle: list[_Connection] = []  # kept-alive connections between requests
        self.open: set[_Connection] = set()  # every connection not yet lost

    async def _connection(self, fresh: bool = False) -> tuple[_Connection, bool]:
        while self.idle and not fresh:
            conn = self.idle.pop()
            if not conn.closed:
                return conn, True
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self.ssl)
        self.open.add(conn)
        return conn, False

    def _request_bytes(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host_header}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")

    async def request(self, method: str, path: str, body: bytes | None = None,
                      headers: dict[str, str] | None = None, on_data: OnData | None = None) -> tuple[int, bytes]:
        """(status, body) once the response has ended. With `on_data`, a 200 response's `data:` lines
        go to it as they arrive (until it returns True; the rest is read and dropped, so the connection
        can serve the next request) and the body returned is empty."""
        raw = self._request_bytes(method, path, body, headers or {})
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            conn, reused = await self._connection(fresh=attempt > 0)  # a retry never reuses: the next idle one may be stale too
            ex = _Exchange(on_data, loop.create_future())
            conn.send(ex, raw)
            try:
                return await ex.done
            except HTTPError:
                # a kept-alive connection the server closed while idle: retry once on a fresh one
                if reused and not ex.got_bytes and attempt == 0:
                    continue
                raise
            except BaseException:  # cancelled or timed out mid-response: the connection is not reusable
                conn.reusable = False
                conn.transport.close()
                raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for conn in list(self.open):
            conn.transport.close()
        self.idle.clear()
        await asyncio.sleep(0)  # let the transports run their close callbacks before the loop ends
