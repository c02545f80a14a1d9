"""A fake OpenAI-compatible server that answers as fast as it can: the yardstick for the ceiling of
`ketch bench serve` itself (issue 13), which must never be what limits a serving figure.

    python -m ketch.bench.fake_server --port N [--workers K] [--step-ms S]

- `/v1/completions` and `/v1/chat/completions` (streamed or whole), `/v1/models`, `/health`.
- Every answer is exactly `max_tokens` tokens (default 16) of " tok" (one token per piece for the
  bundled tokenizer, so a client that counts text agrees with the usage), finish_reason "length";
  `ignore_eos`, `temperature` and other sampling fields are accepted and ignored. The fake has no
  tokenizer: `prompt_tokens` is the prompt's UTF-8 byte count.
- Streams look like `ketch serve`'s: one token per SSE event (chat: a role chunk first and a
  finish chunk last), a usage chunk when `stream_options.include_usage` asks, then `[DONE]`.
- One step loop per process writes the next event of every open stream, then yields to the event
  loop (with `--step-ms S`, steps start every S ms): a continuous-batching server without a model.
  A stream whose socket buffer is full sits steps out until its client drains it; nothing is
  dropped or merged.
- HTTP/1.1 on asyncio protocols with httptools; a request's frames are built once, so an event
  costs one `transport.write` of ready bytes.
- `--workers K`: K processes, each with its own socket on the port (SO_REUSEPORT: the kernel
  spreads connections over them). `fake server listening on http://HOST:PORT` is printed once all
  of them listen; `--port 0` picks a free port.
- It imports nothing from ketch, so `python ketch/bench/fake_server.py` also runs it, without the
  package's start-up (torch).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import time
from typing import Any

import httptools
import msgspec

TOKEN = " tok"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
_json = msgspec.json.Encoder()


def _chunked(data: bytes) -> bytes:
    """One HTTP/1.1 chunk (Transfer-Encoding: chunked) carrying `data`."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj: Any) -> bytes:
    return _chunked(b"data: " + _json.encode(obj) + b"\n\n")


_DONE = _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"  # the last event, then the end of the chunked body


class BadRequest(Exception):
    pass


class Answer:
    """One request's frames, built once: `head` now, `mid` on each of the next `repeats` steps,
    `tail` on the step after (the last token's event, finish, usage, [DONE])."""

    __slots__ = ("head", "mid", "repeats", "tail")

    def __init__(self, head: bytes, mid: bytes, repeats: int, tail: bytes) -> None:
        self.head, self.mid, self.repeats, self.tail = head, mid, repeats, tail


def _response_head(status: int, content_type: str, length: int | None, keep_alive: bool) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
    size = f"content-length: {length}\r\n" if length is not None else "transfer-encoding: chunked\r\n"
    conn = "keep-alive" if keep_alive else "close"
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n{size}"
            f"connection: {conn}\r\n\r\n").encode()


def _json_response(status: int, obj: Any, keep_alive: bool) -> bytes:
    body = _json.encode(obj)
    return _response_head(status, "application/json", len(body), keep_alive) + body


def _error(status: int, message: str, keep_alive: bool) -> bytes:
    return _json_response(status, {"error": {"message": message, "type": "invalid_request_error",
                                             "code": status}}, keep_alive)


def _prompt_bytes(body: dict, chat: bool) -> int:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: a non-empty list is required")
        return sum(len(str(m.get("content", "")).encode()) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("prompt: a string is required")
    return len(prompt.encode())


def _max_tokens(body: dict, chat: bool) -> int:
    n = body.get("max_completion_tokens") if chat else None
    n = body.get("max_tokens", DEFAULT_MAX_TOKENS) if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BadRequest(f"max_tokens: must be an integer >= 1, got {n!r}")
    return n


class FakeApp:
    """Answers requests; `answer` returns bytes to write at once, or an Answer to stream."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.created = int(time.time())
        self.count = 0

    def answer(self, method: bytes, path: bytes, body: bytes, keep_alive: bool) -> bytes | Answer:
        path = path.split(b"?", 1)[0]
        if method == b"GET" and path == b"/v1/models":
            return _json_response(200, {"object": "list", "data": [
                {"id": self.model, "object": "model", "created": self.created, "owned_by": "fake"}]}, keep_alive)
        if method == b"GET" and path == b"/health":
            return _response_head(200, "text/plain", 0, keep_alive)
        if method != b"POST" or path not in (b"/v1/completions", b"/v1/chat/completions"):
            return _error(404, f"no route {method.decode()} {path.decode(errors='replace')}", keep_alive)
        chat = path == b"/v1/chat/completions"
        try:
            req = msgspec.json.decode(body)
            if not isinstance(req, dict):
                raise BadRequest("body: a JSON object is required")
            n, n_prompt = _max_tokens(req, chat), _prompt_bytes(req, chat)
        except (BadRequest, msgspec.DecodeError) as e:
            return _error(400, str(e), keep_alive)
        self.count += 1
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        rid = f"{'chatcmpl' if chat else 'cmpl'}-fake-{os.getpid()}-{self.count}"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": self.created, "model": self.model}
        if not req.get("stream"):
            return self._whole(head, chat, n, usage, keep_alive)
        with_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        return (self._chat_stream if chat else self._completion_stream)(head, n, usage, with_usage, keep_alive)

    def _whole(self, head: dict, chat: bool, n: int, usage: dict, keep_alive: bool) -> bytes:
        text = TOKEN * n
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": "length"}
            return _json_response(200, {**head, "object": "chat.completion", "choices": [choice], "usage": usage},
                                  keep_alive)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        return _json_response(200, {**head, "choices": [choice], "usage": usage}, keep_alive)

    @staticmethod
    def _usage_tail(head: dict, usage: dict, with_usage: bool) -> bytes:
        return (_event({**head, "choices": [], "usage": usage}) if with_usage else b"") + _DONE

    def _completion_stream(self, head: dict, n: int, usage: dict, with_usage: bool, keep_alive: bool) -> Answer:
        extra = {"usage": None} if with_usage else {}
        mid = _event({**head, "choices": [{"index": 0, "text": TOKEN, "logprobs": None, "finish_reason": None}],
                      **extra})
        last = _event({**head, "choices": [{"index": 0, "text": TOKEN, "logprobs": None, "finish_reason": "length",
                                            "matched_stop": None}], **extra})
        start = _response_head(200, "text/event-stream", None, keep_alive)
        return Answer(start, mid, n - 1, last + self._usage_tail(head, usage, with_usage))

    def _chat_stream(self, head: dict, n: int, usage: dict, with_usage: bool, keep_alive: bool) -> Answer:
        extra = {"usage": None} if with_usage else {}

        def chunk(delta: dict, finish: str | None) -> bytes:
            return _event({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                "finish_reason": finish}], **extra})

        start = _response_head(200, "text/event-stream", None, keep_alive)
        start += chunk({"role": "assistant", "content": ""}, None)
        mid = chunk({"content": TOKEN}, None)
        return Answer(start, mid, n - 1, mid + chunk({}, "length") + self._usage_tail(head, usage, with_usage))


class Stream:
    __slots__ = ("conn", "answer", "left")

    def __init__(self, conn: Connection, answer: Answer) -> None:
        self.conn, self.answer, self.left = conn, answer, answer.repeats


class Stepper:
    """The step loop: each step writes one event to every open stream that can take it."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.streams: list[Stream] = []
        self.joining: list[Stream] = []  # added between steps (a finished stream can start the next request)
        self.wake = asyncio.Event()

    def add(self, stream: Stream) -> None:
        self.joining.append(stream)
        self.wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            if self.joining:
                self.streams += self.joining
                self.joining = []
            if not self.streams:
                self.wake.clear()
                await self.wake.wait()
                due = loop.time()
                continue
            keep: list[Stream] = []
            wrote = False
            for s in self.streams:
                conn = s.conn
                if conn.closed:
                    continue
                if conn.paused:  # its client has not drained the socket: no event this step
                    keep.append(s)
                    continue
                wrote = True
                if s.left:
                    conn.transport.write(s.answer.mid)
                    s.left -= 1
                    keep.append(s)
                else:
                    conn.transport.write(s.answer.tail)
                    conn.response_done()
            self.streams = keep
            if wrote or self.joining:
                # steps start at a fixed rate (a step's own work does not stretch the period); a late
                # step is followed at once, not by a burst that catches up
                due = max(due + self.step_s, loop.time())
                await asyncio.sleep(due - loop.time())
            else:  # every open stream waits on its client: sleep until one drains, not spin
                self.wake.clear()
                await self.wake.wait()
                due = loop.time()


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; requests are answered in order (a pipelined one waits its turn)."""

    def __init__(self, app: FakeApp, stepper: Stepper) -> None:
        self.app, self.stepper = app, stepper
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = self.paused = self.busy = False
        self.url = b""
        self.body: list[bytes] = []
        self.queue: list[tuple[bytes, bytes, bytes, bool]] = []
        self.keep_alive = True

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.transport.write(_error(400, f"bad HTTP: {e}", keep_alive=False))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.stepper.wake.set()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.queue.append((self.parser.get_method(), self.url, b"".join(self.body), self.parser.should_keep_alive()))
        if not self.busy:
            self._next()

    def _next(self) -> None:
        while self.queue and not self.closed:
            method, url, body, self.keep_alive = self.queue.pop(0)
            out = self.app.answer(method, url, body, self.keep_alive)
            if isinstance(out, Answer):
                self.busy = True
                self.transport.write(out.head)
                self.stepper.add(Stream(self, out))
                return
            self.transport.write(out)
            if not self.keep_alive:
                self.transport.close()
                return

    def response_done(self) -> None:
        self.busy = False
        if not self.keep_alive:
            self.transport.close()
        else:
            self._next()


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # one socket per worker, one port
    sock.bind((host, port))
    sock.listen(4096)
    return sock


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _serve(sock: socket.socket, model: str, step_s: float, lifeline: int | None) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        app, stepper = FakeApp(model), Stepper(step_s)
        server = await loop.create_server(lambda: Connection(app, stepper), sock=sock)
        stepping = asyncio.create_task(stepper.run())
        stop = loop.create_future()
        if lifeline is not None:  # the first worker's end closes the pipe: this worker ends with it
            loop.add_reader(lifeline, lambda: stop.done() or stop.set_result(None))
        await stop
        stepping.cancel()
        server.close()

    with asyncio.Runner(loop_factory=_new_loop) as runner:
        runner.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ketch.bench.fake_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    p.add_argument("--workers", type=int, default=1, help="processes sharing the port")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="a step every this many ms (a server's decode step); 0: as fast as it can")
    p.add_argument("--model", default="fake-model")
    a = p.parse_args(argv)
    if a.workers < 1 or a.step_ms < 0:
        p.error("--workers must be >= 1 and --step-ms >= 0")
    sock = _listen(a.host, a.port)
    port = sock.getsockname()[1]
    ready_r, ready_w = os.pipe()
    life_r, life_w = os.pipe()  # only this process holds the write end: its exit is the workers' EOF
    children = []
    for _ in range(a.workers - 1):  # forked before any event loop or thread exists
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C ends the first worker; the lifeline ends this one
            os.close(ready_r)
            os.close(life_w)
            sock.close()
            own = _listen(a.host, port)
            os.write(ready_w, b"1")
            os.close(ready_w)
            _serve(own, a.model, a.step_ms / 1000, life_r)
            os._exit(0)
        children.append(pid)
    os.close(ready_w)
    os.close(life_r)
    for _ in children:
        if not os.read(ready_r, 1):
            raise SystemExit("fake server: a worker died before listening")
    print(f"fake server listening on http://{a.host}:{port} ({a.workers} worker(s))", flush=True)
    try:
        _serve(sock, a.model, a.step_ms / 1000, None)
    except KeyboardInterrupt:
        pass
    finally:
        os.close(life_w)
        for pid in children:
            os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
