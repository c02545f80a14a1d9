"""Bad input, limits and shutdown of `ketch serve`: every error an OpenAI error body with the right
status, the server serving on afterwards; a full queue is a 429; SIGTERM drains in-flight requests
within --shutdown-timeout and exits 0; a dead engine means 503."""
from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time

import pytest
from server_util import (connect, health, metrics, open_stream, pages_all_back, post, post_with_headers,
                         running_server, wait_for)

from ketch.server.http_protocol import MAX_HEADER_BYTES

MAX_BODY = 200_000
LONG = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with running_server("--max-request-bytes", str(MAX_BODY)) as running:
        yield running


def _assert_error(status: int, body: dict, want_status: int, param: str | None = None, code: str | None = None):
    assert status == want_status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]
BAD = [
    # path, body (dict or raw), status, param, code
    (CHAT, b'{"messages": [', 400, None, "invalid_json"),
    (CMPL, b"\xff\xfe not utf-8", 400, None, "invalid_json"),
    (CHAT, b"[1, 2, 3]", 400, None, "invalid_json"),
    (CHAT, {"messages": "hello"}, 400, "messages", "invalid_type"),
    (CHAT, {"messages": USER, "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    (CHAT, {"messages": USER, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    (CHAT, {"messages": USER, "n": 1.5}, 400, "n", "invalid_type"),
    (CHAT, {"messages": USER, "stream": "yes"}, 400, "stream", "invalid_type"),
    (CHAT, {"messages": USER, "logprobs": 3}, 400, "logprobs", "invalid_type"),
    (CMPL, {"prompt": {"text": "hi"}}, 400, "prompt", "invalid_type"),
    (CMPL, {"prompt": [1, "a"]}, 400, "prompt", None),
    (CMPL, {"prompt": "hi", "stop": 5}, 400, "stop", "invalid_type"),
    (CHAT, {"messages": USER, "functions": []}, 400, "functions", "unsupported_field"),
    (CMPL, {"prompt": "hi", "best_of": 2}, 400, "best_of", "unsupported_value"),  # more samples than n to rank
    (CHAT, {"messages": USER, "store": True}, 400, "store", "unsupported_value"),
    (CHAT, {"messages": USER, "service_tier": "flex"}, 400, "service_tier", "unsupported_value"),
    (CMPL, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "invalid_value"),  # the field sent, not top_logprobs
    (CHAT, {}, 400, "messages", None),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]", None),
    (CHAT, {"messages": USER, "top_p": 2}, 400, "top_p", "invalid_value"),
    (CHAT, {"messages": USER, "n": 0}, 400, "n", "invalid_value"),
    (CHAT, {"messages": USER, "top_logprobs": 3}, 400, "top_logprobs", None),
    (CMPL, {"prompt": "hi", "logit_bias": {"999999999": 5}}, 400, "logit_bias", None),
    (CMPL, {"prompt": [10 ** 9]}, 400, "prompt", None),
    (CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    (CMPL, {"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    (CMPL, {"prompt": "x" * (MAX_BODY + 1)}, 413, None, "request_too_large"),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, path, body, status, param, code):
    _, base = server
    _assert_error(*post(base, path, body), status, param, code)
    assert health(base) == 200


@pytest.mark.parametrize("path, body", [
    (CMPL, {"prompt": "hi", "suffix": None, "best_of": 1, "store": False, "metadata": {"app": "x"},
            "service_tier": "auto", "functions": None}),
    (CHAT, {"messages": USER, "n": 2, "best_of": 2, "store": False, "function_call": None, "reasoning_effort": None}),
])
def test_fields_sdks_send_with_values_that_ask_for_nothing_are_accepted(server, path, body):
    """Official SDKs send optional fields explicitly: null for any field, and store=false,
    best_of=n, metadata, service_tier auto ask for nothing ketch does differently."""
    _, base = server
    status, reply = post(base, path, {**body, "max_tokens": 1})
    assert status == 200, reply


def test_the_clients_request_id_comes_back_and_a_bad_one_is_replaced(server):
    """x-request-id (ketch/request_id.py) on answers of every kind: a generation, a 400, a stream;
    an unusable one (a space in it) is replaced by the server's own 16 hex digits."""
    _, base = server
    for path, body, want, sent in ((CMPL, {"prompt": "hi", "max_tokens": 1}, 200, "trace-1/a"),
                                   (CHAT, {"messages": "hello"}, 400, "trace-2"),
                                   (CMPL, {"prompt": "hi", "max_tokens": 1, "stream": True}, 200, "trace-3"),
                                   (CMPL, {"prompt": "hi", "max_tokens": 1}, 200, "not usable")):
        conn = connect(base)
        try:
            conn.request("POST", path, json.dumps(body), {"content-type": "application/json", "x-request-id": sent})
            resp = conn.getresponse()
            resp.read()
            ids = [v for k, v in resp.getheaders() if k.lower() == "x-request-id"]
        finally:
            conn.close()
        assert resp.status == want
        if " " in sent:
            assert len(ids) == 1 and len(ids[0]) == 16 and int(ids[0], 16) >= 0
        else:
            assert ids == [sent]


def test_prompt_over_the_context_names_both_numbers(server):
    _, base = server
    status, body = post(base, CMPL, {"prompt": list(range(100, 100 + 9000)), "max_tokens": 1})
    _assert_error(status, body, 400, "prompt", "context_length_exceeded")
    assert "9000" in body["error"]["message"] and "8192" in body["error"]["message"]


def test_oversized_body_without_content_length_is_413(server):
    _, base = server
    conn = connect(base)
    conn.putrequest("POST", CMPL)
    conn.putheader("content-type", "application/json")
    conn.putheader("transfer-encoding", "chunked")
    conn.endheaders()
    payload = json.dumps({"prompt": "y" * (2 * MAX_BODY)}).encode()
    for i in range(0, len(payload), 16384):
        piece = payload[i:i + 16384]
        try:
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        except (BrokenPipeError, ConnectionResetError):
            break  # the server answered and closed before the whole body was sent
    else:
        conn.send(b"0\r\n\r\n")
    resp = conn.getresponse()
    _assert_error(resp.status, json.loads(resp.read()), 413, code="request_too_large")
    conn.close()


def test_http_edges_allow_on_405_head_on_health_and_a_client_leaving_mid_body(server):
    """A 405 says what is allowed; load balancers may probe /health with HEAD; a client that leaves
    while its body is coming in is an ordinary end (a 400 for nobody), not a logged server error."""
    import asyncio

    from starlette.requests import Request

    from ketch.server.body import read_body
    from ketch.server.errors import APIError

    _, base = server
    conn = connect(base)
    conn.request("PUT", CMPL, "{}", {"content-type": "application/json"})
    resp = conn.getresponse()
    _assert_error(resp.status, json.loads(resp.read()), 405)
    assert "POST" in resp.getheader("allow", "")
    conn.close()  # (answered before its body was read, that connection may be closed by the server)
    conn = connect(base)
    conn.request("HEAD", "/health")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == b""
    conn.close()

    async def gone() -> dict:
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": CMPL, "headers": [(b"content-length", b"100")]}
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(Request(scope, gone), MAX_BODY, 5.0))
    assert (e.value.status, e.value.code) == (400, "client_disconnected")


@pytest.mark.parametrize("path, length, status", [("/nope", 1000, 404), (CMPL, MAX_BODY + 1, 413)])
def test_an_answer_given_before_the_body_came_closes_the_connection(server, path, length, status):
    """A 404 (or 401, 413, 408) given while the announced body has not all come: the server closes
    the connection, and says so (`connection: close`: a client learnt it only when it reused the
    connection). It used to read and drop the rest for as long as the client trickled it, with
    no deadline left: any client, key or not, could hold a connection slot forever."""
    _, base = server
    sock = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 f"content-length: {length}\r\n\r\n".encode())
    sock.settimeout(30)  # a deadline for a broken server, not a synchronisation
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    assert resp.status == status
    assert resp.getheader("connection") == "close"
    resp.read()
    try:  # one more body byte: it used to postpone the keep-alive timeout, and nothing else closed it
        sock.sendall(b"x")
        closed = sock.recv(1) == b""
    except ConnectionResetError:  # the byte met the closed socket
        closed = True
    assert closed  # (a server that kept it open fails on the timeout above)
    sock.close()


def _head(path: str, size: int, method: str = "GET", fields: bytes = b"") -> bytes:
    """A request line and headers of exactly `size` bytes: one padding header fills them."""
    start = f"{method} {path} HTTP/1.1\r\nhost: x\r\n".encode() + fields + b"x-pad: "
    return start + b"p" * (size - len(start) - 4) + b"\r\n\r\n"


def _answer(sock: socket.socket) -> tuple[http.client.HTTPResponse, bytes]:
    sock.settimeout(30)  # a deadline for a broken server, not a synchronisation
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    return resp, resp.read()


def _assert_431_and_closed(sock: socket.socket) -> None:
    resp, body = _answer(sock)
    _assert_error(resp.status, json.loads(body), 431, code="request_headers_too_large")
    assert resp.getheader("connection") == "close"
    try:
        closed = sock.recv(1) == b""
    except ConnectionResetError:  # the rest of what was sent met the closed socket
        closed = True
    assert closed
    sock.close()


def _send_all_it_takes(sock: socket.socket, data: bytes, piece: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i in range(0, len(data), piece):
        try:
            sock.sendall(data[i:i + piece])
        except (BrokenPipeError, ConnectionResetError):
            return  # the server answered and closed before all of it was sent


OVER_THE_CAP = {
    "one long line": _head("/health", MAX_HEADER_BYTES + 1),
    "many lines": b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"".join(
        b"x-h%05d: v\r\n" % i for i in range(MAX_HEADER_BYTES // 12)) + b"\r\n",
    "a line that never ends": b"GET /health HTTP/1.1\r\nx-pad: " + b"p" * (2 * MAX_HEADER_BYTES),
}


@pytest.mark.parametrize("piece", [None, 1000], ids=["one send", "many small sends"])
@pytest.mark.parametrize("head", OVER_THE_CAP.values(), ids=OVER_THE_CAP.keys())
def test_a_head_over_the_cap_is_a_431_that_closes_the_connection(server, head, piece):
    """Request line and headers beyond --max-header-bytes (64 KiB): counted as the bytes come,
    whether the head ends or not (the server used to buffer them until --header-timeout)."""
    _, base = server
    sock = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    _send_all_it_takes(sock, head, piece or len(head))
    _assert_431_and_closed(sock)
    assert health(base) == 200


def test_a_head_at_the_cap_is_served_with_its_body_and_each_request_has_its_own_cap(server):
    """Exactly MAX_HEADER_BYTES of head, its body in the same send (a read past the cap that holds
    the head's end): served, and the connection kept; so is a second such request on it. One byte
    more on the same connection is a 431."""
    _, base = server
    sock = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    body = b'{"prompt": "Hi"}' + b" " * 150_000  # (under --max-request-bytes)
    fields = b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
    for _ in range(2):
        sock.sendall(_head("/tokenize", MAX_HEADER_BYTES, "POST", fields) + body)
        resp, answer = _answer(sock)
        assert resp.status == 200, answer
        assert resp.getheader("connection") != "close"
    sock.sendall(_head("/tokenize", MAX_HEADER_BYTES + 1, "POST", fields) + body)
    _assert_431_and_closed(sock)


def test_all_errors_left_every_page_free(server):
    """The bad input above is turned away before the engine; these requests end early inside it:
    a stream whose client goes away (the engine aborts it) and a stop string that ends one. Then
    the engine has every page back, and a normal request runs."""
    _, base = server
    abort = 'ketch_requests_finished_total{finish_reason="abort"}'
    before = metrics(base)
    assert pages_all_back(before), before
    conn, _ = open_stream(base, CMPL, LONG)  # its first token is out: the engine holds its pages
    assert metrics(base)["ketch_kv_pages_used"] > 0
    conn.close()
    status, body = post(base, CMPL, {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
                                     "stop": ["France", " is", "."]})
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop", body
    wait_for(lambda: pages_all_back(metrics(base)), "the early-ended requests' pages to return")
    after = metrics(base)
    assert after[abort] - before.get(abort, 0) == 1
    assert after["ketch_prompt_tokens_total"] > before.get("ketch_prompt_tokens_total", 0)  # they reached the engine
    status, body = post(base, CMPL, {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_full_queue_is_429_and_sigterm_drains(tmp_path):
    """Three running sequences at most, none queued: a fourth request is turned away with a 429.
    Then SIGTERM with a short request and two long ones in flight (a stream and a whole answer):
    the short one finishes; at --shutdown-timeout the long stream ends with a `server_shutdown`
    error event and [DONE], the whole answer is a 503; the server exits 0."""
    timeout = 10
    with running_server("--max-running-requests", "3", "--max-queued-requests", "0",
                        "--shutdown-timeout", str(timeout)) as (proc, base):
        streams = [open_stream(base, CMPL, LONG) for _ in range(3)]
        status, headers, body = post_with_headers(base, CMPL, {"prompt": "Hi", "max_tokens": 2})
        _assert_error(status, body, 429, code="queue_full")
        assert body["error"]["type"] == "rate_limit_error"
        assert int(headers["retry-after"]) >= 1  # when to come back (the openai client waits it out)
        status, body = post(base, CMPL, {"prompt": "Hi", "max_tokens": 2, "n": 4})
        _assert_error(status, body, 400, param="n")  # could never fit: not a retry-later
        status, body = post(base, CMPL, {"prompt": ["Hi"] * 4, "max_tokens": 2})  # four prompts, n = 1
        _assert_error(status, body, 400, param="prompt")
        assert metrics(base)['ketch_requests_rejected_total{reason="queue_full"}'] == 1

        def in_engine() -> float:
            m = metrics(base)
            return m["ketch_num_requests_running"] + m["ketch_num_requests_waiting"]

        streams[0][0].close()  # a slot frees once the server has aborted the dropped stream
        wait_for(lambda: in_engine() == 2, "the dropped stream's slot")
        short = open_stream(base, CMPL, {"prompt": "The capital of France is", "max_tokens": 24, "ignore_eos": True})
        streams[1][0].close()
        wait_for(lambda: in_engine() == 2, "the second dropped stream's slot")
        whole: list[tuple[int, dict]] = []
        waiting = threading.Thread(target=lambda: whole.append(post(base, CMPL, LONG, timeout=timeout + 30)))
        waiting.start()
        wait_for(lambda: in_engine() == 3, "the whole-answer request in the engine")

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = short[1].read().decode()
        assert '"finish_reason": "length"' in rest and rest.rstrip().endswith("data: [DONE]")
        cut = streams[2][1].read().decode()  # not a truncated body: an error event, then [DONE]
        assert '"code": "server_shutdown"' in cut and cut.rstrip().endswith("data: [DONE]"), cut[-300:]
        waiting.join(timeout=timeout + 30)
        _assert_error(*whole[0], 503, code="server_shutdown")
        assert proc.wait(timeout=timeout + 30) == 0
        assert time.monotonic() - t0 >= timeout - 1
        out = proc.stdout.read()
        assert "shut down" in out


def test_dead_engine_is_503():
    """The app alone, with an engine client whose process is gone: every generation route and
    /health answer 503 with an OpenAI error body."""
    from fastapi.testclient import TestClient

    from ketch.server.app import build_app
    from ketch.server.state import ServerState

    class DeadEngine:
        alive, ready, failure = False, None, "the engine process exited (code 1)"

        def healthy(self) -> str:
            return self.failure

        async def stats(self, timeout: float):
            return None

    app = TestClient(build_app(ServerState(DeadEngine(), None, None, "m"), max_request_bytes=1 << 20))
    for path, body in [(CMPL, {"prompt": [1, 2]}), (CHAT, {"messages": USER})]:
        resp = app.post(path, json=body)
        _assert_error(resp.status_code, resp.json(), 503, code="engine_unavailable")
    resp = app.get("/health")
    _assert_error(resp.status_code, resp.json(), 503, code="engine_unavailable")
