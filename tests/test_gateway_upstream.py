"""The gateway's HTTP/1.1 client toward workers (ketch/gateway/upstream.py), against a real socket
server on loopback that answers the way a worker may: keep-alive, chunked streams, a close just
after answering, silence, a cut mid-body, a client that stops reading."""
from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from ketch.gateway.upstream import _HIGH_WATER, ConnectFailed, Upstream, UpstreamLost, UpstreamTimeout

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Worker:
    """A raw HTTP server: `handler(reader, writer, request_no_on_this_connection)` answers each
    request; counts connections and records when one was seen closed by the client."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.connections, self.requests = handler, 0, []
        self.closed_by_client = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                if not await self.handler(reader, writer, n):
                    break
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def sse_answer(reader, writer, n) -> bool:  # three events, chunked, keep-alive
    writer.write(STREAM_HEAD)
    for i in range(3):
        writer.write(chunk(b"data: %d\n\n" % i))
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_a_stream_arrives_whole_and_the_connection_is_reused():
    async def go():
        worker = Worker(sse_answer)
        async with worker as url:
            up = Upstream(2, 5)
            for _ in range(5):
                answer = await up.request("POST", url, "/v1/completions", b'{"a": 1}', {"authorization": "Bearer k"})
                assert answer.status_code == 200 and answer.content_type == "text/event-stream"
                assert await answer.read() == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
                answer.close()
            up.close()
        assert worker.connections == 1  # keep-alive: one socket for five requests
        assert worker.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"authorization: Bearer k" in worker.requests[0] and worker.requests[0].endswith(b'{"a": 1}')
    run(go())


def test_an_answer_paused_for_its_reader_leaves_a_connection_that_reads_again():
    """A piped stream whose reader was backed up when its last piece arrived ends with reading
    paused on its socket; the socket goes back to the pool, and the next request on it must get
    its answer (it got nothing until the read timeout, a 504 charged to a healthy worker)."""
    async def go():
        worker = Worker(sse_answer)
        async with worker as url:
            up = Upstream(2, 5)  # the bug's outcome is this read timeout, not a wait for success
            for _ in range(3):
                answer = await up.request("POST", url, "/v1/completions", b"{}", {})
                got: list[bytes] = []
                answer.pipe(got.append, lambda: True)  # a reader that is always behind
                while not await answer.piped():
                    answer.resume()
                assert b"".join(got) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
                answer.close()
            up.close()
        assert worker.connections == 1  # the same socket served all three
    run(go())


def test_a_connection_closed_by_the_worker_after_its_answer_is_not_reused_silently():
    async def answer_then_close(reader, writer, n) -> bool:  # says keep-alive, then closes (idle timeout)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        return False

    async def go():
        worker = Worker(answer_then_close)
        async with worker as url:
            up = Upstream(2, 5)
            for _ in range(3):
                answer = await up.request("GET", url, "/v1/models", None, {})
                assert await answer.read() == b"ok"
                answer.close()
                await asyncio.sleep(0)  # let the close reach us or not: both must work
            up.close()
        assert worker.connections == 3
    run(go())


def test_a_reused_connection_lost_before_any_answer_is_retried_once_fresh():
    """The race the idle expiry narrows: the worker closes a kept-alive socket just as a request
    is written on it. The request goes once more on a new connection."""
    async def first_keeps_second_drops(reader, writer, n) -> bool:
        if n == 0:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            return True
        writer.transport.abort()  # request 2 on this connection: read, never answered
        return False

    async def go():
        worker = Worker(first_keeps_second_drops)
        async with worker as url:
            up = Upstream(2, 5)
            for _ in range(2):
                answer = await up.request("GET", url, "/x", None, {})
                assert await answer.read() == b"ok"
                answer.close()
            up.close()
        assert worker.connections == 2 and len(worker.requests) == 3
    run(go())


def test_silence_past_the_read_timeout_fails_before_and_after_the_headers():
    async def silent(reader, writer, n) -> bool:
        await reader.readexactly(1)  # nothing comes: returns (raises) when the client closes
        return False

    async def one_event_then_silence(reader, writer, n) -> bool:
        writer.write(STREAM_HEAD + chunk(b"data: 0\n\n"))
        await writer.drain()
        await reader.readexactly(1)
        return False

    async def go():
        async with Worker(silent) as url:
            up = Upstream(2, 0.3)
            with pytest.raises(UpstreamTimeout):
                await up.request("POST", url, "/v1/completions", b"{}", {})
        worker = Worker(one_event_then_silence)
        async with worker as url:
            # the head and the first event must beat the timeout: 1.5 s, room for a pause of this
            # process (the worker runs in it) between the request and its answer
            answer = await up.request("POST", url, "/v1/completions", b"{}", {}, read_timeout=1.5)
            got = []
            with pytest.raises(UpstreamTimeout):
                async for data in answer.chunks():
                    got.append(data)
            assert got == [b"data: 0\n\n"]
            answer.close()
            await asyncio.wait_for(worker.closed_by_client.wait(), 5)
    run(go())


def test_a_cut_mid_body_is_lost_and_closing_early_tells_the_worker():
    async def cut(reader, writer, n) -> bool:
        writer.write(STREAM_HEAD + chunk(b"data: 0\n\n"))
        await writer.drain()
        writer.transport.abort()
        return False

    async def endless(reader, writer, n) -> bool:
        writer.write(STREAM_HEAD)
        while True:
            writer.write(chunk(b"data: x\n\n"))
            await writer.drain()
            await asyncio.sleep(0.01)

    async def go():
        up = Upstream(2, 5)
        async with Worker(cut) as url:
            answer = await up.request("POST", url, "/", b"{}", {})
            with pytest.raises(UpstreamLost):
                await answer.read()
            answer.close()
        worker = Worker(endless)
        async with worker as url:
            answer = await up.request("POST", url, "/", b"{}", {})
            async for _ in answer.chunks():
                break
            answer.close()  # the client left: the worker must see its socket close
            await asyncio.wait_for(worker.closed_by_client.wait(), 5)
    run(go())


def test_a_refused_connection_is_a_connect_failure():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused

        async def go():
            with pytest.raises(ConnectFailed) as e:
                await Upstream(2, 5).request("GET", f"http://127.0.0.1:{port}", "/", None, {})
            assert not e.value.timed_out
        run(go())


def test_a_client_that_stops_reading_pauses_the_worker_not_the_timeout():
    """Nothing read for longer than the read timeout while the buffer is full: reading is paused
    (memory bounded), the silence is the client's, so no timeout; then it reads everything."""
    total = 8 * _HIGH_WATER

    async def big(reader, writer, n) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()
        return True

    async def go():
        async with Worker(big) as url:
            up = Upstream(2, 1.0)  # the head must come within it, even if this process pauses
            answer = await up.request("GET", url, "/", None, {})
            await asyncio.sleep(2.5)  # the client is slow, past the timeout; bounded wait, the assertion is below
            assert answer._buffered <= 2 * _HIGH_WATER  # paused near the high-water mark
            assert len(await answer.read()) == total
            answer.close()
            up.close()
    run(go())
