"""How the gateway relays a stream (ketch/gateway/relay.py, client_stream.py): whole events only,
token ids stripped for the client but kept for failover, the end after everything else; the
events written from the worker connection's callback (uvicorn's transport) or, under any other
ASGI server, handed to `send` by the relay task; a client that stops reading holds the worker
back instead of filling the gateway's memory, and is not taken for the worker's silence."""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import socket
import time

import pytest
from gateway_util import running_gateway
from test_gateway_upstream import Worker, chunk, run

from ketch.gateway.attempt import Attempt
from ketch.gateway.config import GatewayConfig
from ketch.gateway.failover import NoFailover, StreamTranscript
from ketch.gateway.gateway import Gateway
from ketch.gateway.relay import _Events, relay
from ketch.gateway.routed import COMPLETIONS, routed_request
from ketch.gateway.upstream import Upstream

STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class Recorder:
    """A client stream that keeps what it is given."""

    def __init__(self) -> None:
        self.blocks: list[bytes] = []

    def write(self, block: bytes) -> None:
        self.blocks.append(block)

    def backed_up(self) -> bool:
        return False

    async def flush(self) -> None:
        pass


def test_events_go_out_whole_whatever_the_reads_and_ids_only_to_the_transcript():
    client, transcript = Recorder(), StreamTranscript(keep_events=True)
    events = _Events(client, transcript, strip=True)
    one = b'data: {"choices": [{"text": "a", "token_ids": [1, 2]}]}\n\n'
    two = b'data: {"choices": [{"text": "b", "token_ids": [3]}]}\n\n'
    done = b"data: [DONE]\n\n"
    stream = one + two + done
    for piece in (stream[:5], stream[5:len(one) + 3], stream[len(one) + 3:-1], stream[-1:]):
        events.feed(piece)
    assert client.blocks == [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
                             done]
    assert b"".join(transcript.blocks) == stream and transcript.events == 3 and transcript.done
    assert events.cutter.pending == b""


@pytest.mark.parametrize("cut", [False, True])
def test_under_another_asgi_server_the_task_sends_every_event_then_the_end(cut: bool):
    """`send` not uvicorn's: the queued client. Every event reaches `send`, in order, before the
    end; a stream cut before [DONE] ends with the lost event after them and is charged to the worker."""
    body = json.dumps({"model": "m", "prompt": "hi", "stream": True}).encode()
    events = [b"data: %d\n\n" % i for i in range(50)] + ([] if cut else [b"data: [DONE]\n\n"])

    async def answer(reader, writer, n) -> bool:
        # each event split over two chunks, all in one write (then the end of the body, or a
        # close): what the gateway holds when the answer ends must still reach the client
        writer.write(STREAM_HEAD + b"".join(chunk(e[:3]) + chunk(e[3:]) for e in events)
                     + (b"" if cut else b"0\r\n\r\n"))
        await writer.drain()
        return not cut

    async def go():
        async with Worker(answer) as url:
            gw = Gateway(GatewayConfig(worker_urls=[url], policy="round_robin"))
            worker = gw.registry.all()[0]
            up = Upstream(2, 5)
            answer_ = await up.request("POST", url, "/v1/completions", body, {})
            sent: list[dict] = []

            async def send(message: dict) -> None:
                sent.append(message)

            request = routed_request(COMPLETIONS, body, json.loads(body))
            whole = await relay(send, Attempt(worker, COMPLETIONS, gw.metrics, gw.clock), answer_, request,
                                NoFailover())
            up.close()
            return whole, sent, worker

    whole, sent, worker = run(go())
    assert whole is not cut
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    bodies = b"".join(m["body"] for m in sent[1:-1])
    assert bodies.startswith(b"".join(events))
    rest = bodies[len(b"".join(events)):]
    if cut:
        assert b'"code": "worker_lost"' in rest and rest.endswith(b"data: [DONE]\n\n")
    else:
        assert rest == b""
    assert worker.in_flight == 0 and worker.breaker._failures == int(cut)


EVENT = b"data: " + json.dumps({"choices": [{"index": 0, "text": "x" * 16_000}]}).encode() + b"\n\n"
EVENTS = 8_192  # 128 MiB: more than every socket buffer on the way (tcp_rmem's ceiling is 32 MiB on some hosts)
TOTAL = EVENTS * len(EVENT)


async def _serve_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, written) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if not head.startswith(b"POST"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
                continue
            writer.write(STREAM_HEAD)
            for _ in range(EVENTS):
                writer.write(chunk(EVENT))
                await writer.drain()
                written.value += len(EVENT)
            writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _streaming_worker_main(ports, written) -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: _serve_stream(r, w, written), "127.0.0.1", 0)
        ports.put(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()  # serves until the test kills the process
    asyncio.run(main())


class StreamingWorker:
    """A worker in a process of its own: GETs get 200 {}, a POST gets EVENTS events and [DONE] as
    fast as its socket takes them; `written` counts the stream's bytes its socket accepted. Not a
    thread of this process: a pause of this process (the client's) must not pause the worker too,
    or the gateway sees a silent worker, which is not this test's subject."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._written = ctx.Value("q", 0)
        ports = ctx.Queue()
        self.proc = ctx.Process(target=_streaming_worker_main, args=(ports, self._written), daemon=True)
        self.proc.start()
        self.port = ports.get(timeout=60)

    @property
    def written(self) -> int:
        return self._written.value

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join(10)


def test_a_client_that_stops_reading_holds_the_worker_back_and_gets_the_whole_stream():
    worker = StreamingWorker()
    try:
        with running_gateway("--worker-urls", f"http://127.0.0.1:{worker.port}", "--policy", "round_robin",
                             "--request-timeout-secs", "1", "--disable-failover") as (_, base):
            port = int(base.rsplit(":", 1)[1])
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            sock.settimeout(30)
            sock.connect(("127.0.0.1", port))
            body = json.dumps({"model": "m", "prompt": "hi", "stream": True, "max_tokens": 5}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            # the client reads nothing for three read timeouts: the scenario, not a synchronisation
            time.sleep(3)
            held_at = worker.written
            received = bytearray()
            while not received.endswith(b"0\r\n\r\n"):
                data = sock.recv(1 << 20)
                assert data, "the gateway closed the stream"
                received += data
            sock.close()
    finally:
        worker.stop()
    assert held_at < TOTAL // 2, f"the worker was not held back: {held_at} of {TOTAL} bytes written"
    head, _, chunked = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"worker_lost" not in chunked  # the client's pause was not the worker's silence
    assert chunked.count(EVENT) == EVENTS and chunked.endswith(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
