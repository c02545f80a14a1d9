"""The gateway's HTTP/1.1 client toward its workers: keep-alive connections, one answer at a time
each, parsed by httptools (uvicorn's own C parser), on plain asyncio protocols.

Why not httpx: at 64 concurrent streams its per-chunk path (httpcore's pool, anyio cancel scopes
around every read, a timeout context per read) cost the gateway more CPU than the relay itself
(docs/performance.md, "Gateway overhead"). Here a chunk costs one parser callback and one future
wakeup; the silence timeout is one timer per answer that re-arms itself from the time of the last
byte instead of a timeout scope around each read.

    pool (per scheme, host, port): idle connections, newest first, dropped after KEEPALIVE_S idle
    request ─ take an idle connection or connect (connect timeout) ─ write head + body ─ await
      the status line and headers (read timeout) ─▶ Answer: chunks() / read() / pipe() / close()
    Answer.close: a finished answer on a keep-alive connection returns it to the pool; anything
      else (unread rest, a cut, the client gone) closes the socket, so the worker sees the
      disconnect and aborts the generation.

A reused connection that fails before any byte of its answer may have been closed by the worker
just as it idled out: the request is sent once more on a fresh connection (the worker never saw
it, or a fresh connect fails too and that failure is what counts).
"""
from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import httptools

# uvicorn (the workers' server) closes an idle keep-alive connection after 5 s; the pool lets go
# of its own first, or a request could be written onto a socket the worker is closing
KEEPALIVE_S = 4.0
MAX_IDLE_PER_ORIGIN = 256
# reading pauses while this much of an answer waits for the relay (a slow client): the worker's
# socket then backs up instead of the gateway's memory
_HIGH_WATER = 1 << 20


def _never() -> bool:
    return False


class UpstreamError(Exception):
    """The worker did not give a whole answer (what is the worker's fault, see attempt.py)."""


class ConnectFailed(UpstreamError):
    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class UpstreamLost(UpstreamError):
    """The connection closed or reset before the answer was complete."""


class _Unanswered(UpstreamLost):
    """Lost before the first byte of the answer."""


class UpstreamTimeout(UpstreamError):
    """The worker was silent for longer than the read timeout."""


class _Connection(asyncio.Protocol):
    """One socket to a worker; at most one answer in flight on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.answer: Answer | None = None

    # ------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None:  # bytes nobody asked for: the connection cannot be trusted
            self.abort()
            return
        answer.last_data = self.loop.time()
        try:
            answer.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            answer.fail(UpstreamLost("the worker switched protocols"))
        except httptools.HttpParserError as e:
            answer.fail(UpstreamLost(f"malformed answer: {e}"))

    def eof_received(self) -> bool | None:
        return False  # close: a worker half-closing mid-answer ends it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.answer is not None:
            self.answer.fail(UpstreamLost(f"connection lost: {exc}" if exc else "connection closed"))

    # ------------------------------------------------------------ use
    def usable(self, now: float) -> bool:
        return not self.closed and now - self.idle_since < KEEPALIVE_S

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Answer:
    """A worker's answer: status and headers at once, the body as it arrives."""

    def __init__(self, conn: _Connection, pool: Upstream, origin: tuple[str, str, int],
                 read_timeout: float) -> None:
        self.conn, self.pool, self.origin = conn, pool, origin
        self.read_timeout = read_timeout  # the longest silence of the worker, before or after the headers
        self.parser = httptools.HttpResponseParser(self)
        self.status_code = 0
        self.keep_alive = False
        self.headers: list[tuple[bytes, bytes]] = []  # names lower-cased
        self.head = conn.loop.create_future()  # set at the end of the headers (or the error)
        self.last_data = conn.loop.time()
        self.got_bytes = False
        self._body: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._error: UpstreamError | None = None
        self._paused = False
        self._sink: Callable[[bytes], None] | None = None  # pipe(): the body's taker, called as it arrives
        self._backed_up: Callable[[], bool] = _never
        self._timer: asyncio.TimerHandle | None = conn.loop.call_at(self.last_data + read_timeout, self._check_silence)

    # ------------------------------------------------------------ httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.got_bytes = True
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.got_bytes = True
        self.status_code = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # read here: the parser forgets it after the body
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._sink is not None:
            self._deliver(body)
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER:
            self._pause()
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._stop_timer()
        self._wake()

    # ------------------------------------------------------------ failures
    def fail(self, error: UpstreamError) -> None:
        if self._complete or self._error is not None:
            return
        self._error = error
        self._stop_timer()
        if not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # retrieved: a caller gone by then must not log it as lost
        self.conn.abort()
        self._wake()

    def _check_silence(self) -> None:
        loop, timeout = self.conn.loop, self.read_timeout
        now, due = loop.time(), self.last_data + timeout
        if self._paused:  # reading paused for a slow client: its silence is not the worker's
            self._timer = loop.call_at(now + timeout, self._check_silence)
            return
        if now < due:  # bytes came since the timer was set
            self._timer = loop.call_at(due, self._check_silence)
            return
        self._timer = None
        self.fail(UpstreamTimeout(f"no byte from the worker for {self.read_timeout:g} s"))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _deliver(self, data: bytes) -> None:
        assert self._sink is not None
        self._sink(data)
        if self._backed_up():  # the client's socket is full: the worker's backs up until it drains
            self._pause()
            self._wake()

    def _pause(self) -> None:
        if not self._paused and self.conn.transport is not None:
            self._paused = True
            self.conn.transport.pause_reading()

    def resume(self) -> None:
        """Reading goes on (after a pause for the reader); the silence timer counts from now."""
        if self._paused and self.conn.transport is not None:
            self._paused = False
            self.last_data = self.conn.loop.time()
            self.conn.transport.resume_reading()

    def _take_buffered(self) -> bytes:
        data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._buffered = 0
        return data

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ------------------------------------------------------------ reading
    @property
    def content_type(self) -> str:
        for name, value in self.headers:
            if name == b"content-type":
                return value.decode("latin-1")
        return ""

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, everything buffered by then in one piece; raises an
        UpstreamError if the answer does not complete."""
        while True:
            if self._body:
                data = self._take_buffered()
                self.resume()
                yield data
                continue
            if self._complete:
                return
            if self._error is not None:
                raise self._error
            self._waiter = self.conn.loop.create_future()
            await self._waiter
            self._waiter = None

    def pipe(self, sink: Callable[[bytes], None], backed_up: Callable[[], bool]) -> None:
        """From now on the body goes to `sink` from the connection's callback as it arrives (what
        arrived before goes at once), with no task woken per piece; after each piece, `backed_up()`
        True pauses reading until `resume()`. Wait with `piped()`."""
        self._sink, self._backed_up = sink, backed_up
        if self._body:
            self._deliver(self._take_buffered())

    async def piped(self) -> bool:
        """For a piped answer: True once it is complete, False when reading paused for the sink's
        reader (resume() after it caught up); raises an UpstreamError if the answer does not complete."""
        while True:
            if self._complete:
                return True
            if self._error is not None:
                raise self._error
            if self._paused:
                return False
            self._waiter = self.conn.loop.create_future()
            await self._waiter
            self._waiter = None

    async def began(self) -> None:
        """Returns once some of the body has arrived, or the answer ended (whole or not); reads
        nothing (PD mode waits for this before the client is given the decode worker's answer)."""
        while not (self._body or self._complete or self._error is not None):
            self._waiter = self.conn.loop.create_future()
            await self._waiter
            self._waiter = None

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def close(self) -> None:
        """Done with the answer: a whole one leaves its connection to the next request."""
        self._stop_timer()
        conn = self.conn
        if conn.answer is not self:
            return
        conn.answer = None
        if self._complete and self._error is None and not conn.closed and self.keep_alive:
            # reading paused for this answer's slow reader (its last piece made it so) must not
            # outlive it: the next answer on the socket would never arrive
            self.resume()
            self.pool.release(self.origin, conn)
        else:
            conn.abort()


class Upstream:
    """The pool: connections per worker origin, reused while they are kept alive."""

    def __init__(self, connect_timeout: float, read_timeout: float) -> None:
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self._idle: defaultdict[tuple[str, str, int], list[_Connection]] = defaultdict(list)
        self._ssl: ssl.SSLContext | None = None

    async def request(self, method: str, url: str, path: str, body: bytes | None,
                      headers: dict[str, str], read_timeout: float | None = None) -> Answer:
        """Send it and wait for the status line and headers; the body is read from the Answer,
        which the caller must close. read_timeout: this answer's longest silence (default: the
        pool's; a metadata read that any healthy worker answers at once takes a shorter one)."""
        origin = _origin(url)
        head = _request_head(method, origin, path, body, headers)
        timeout = self.read_timeout if read_timeout is None else read_timeout
        conn = self._take(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, origin, head, body, timeout)
            except _Unanswered:
                pass  # the worker closed it as it idled out, most likely: once more, fresh
        return await self._exchange(await self._connect(origin), origin, head, body, timeout)

    async def _exchange(self, conn: _Connection, origin: tuple[str, str, int], head: bytes,
                        body: bytes | None, read_timeout: float) -> Answer:
        answer = Answer(conn, self, origin, read_timeout)
        conn.answer = answer
        assert conn.transport is not None
        conn.transport.write(head + body if body else head)
        try:
            await answer.head
        except UpstreamLost as e:
            answer.close()
            if not answer.got_bytes:
                raise _Unanswered(str(e)) from None
            raise
        except BaseException:  # a timeout, or cancelled (the client left): the socket goes
            answer.close()
            raise
        return answer

    def _take(self, origin: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                return conn
            conn.abort()
        return None

    def release(self, origin: tuple[str, str, int], conn: _Connection) -> None:
        idle = self._idle[origin]
        if len(idle) >= MAX_IDLE_PER_ORIGIN:
            conn.abort()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    async def _connect(self, origin: tuple[str, str, int]) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        context = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Connection(loop),
                                                       host.strip("[]"), port, ssl=context)
        except TimeoutError:
            raise ConnectFailed(f"connect timeout ({self.connect_timeout:g} s)", timed_out=True) from None
        except OSError as e:
            raise ConnectFailed(f"cannot connect: {e.strerror or e}") from None
        return conn

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return parts.scheme, f"[{host}]" if ":" in host else host, port


def _request_head(method: str, origin: tuple[str, str, int], path: str, body: bytes | None,
                  headers: dict[str, str]) -> bytes:
    _, host, port = origin
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}:{port}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if body is not None:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
