"""Defects an outside tester found in `ketch serve` (issue 11), each with its reproducer: admission
slots that leaked, unbounded `n` with quadratic aborts, non-streaming requests that ran on for a
client that had left, bodies that got a bare 500, idle connections held forever, a hung engine
that hung every request. Every server here is a real `ketch serve` on loopback."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket

import pytest
from server_util import connect, health, metrics, open_stream, pages_all_back, post, running_server, wait_for

KEY = "k3y-for-tests"
AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]
POST_ROUTES = (CHAT, CMPL, "/tokenize", "/detokenize")


@contextlib.contextmanager
def env(**values: str):
    """Environment variables for a server started inside (the child inherits them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def server():
    """Two sequences at most and no queue, so one leaked slot shows as a 429; the key comes from
    the environment, short header/body deadlines and a small connection cap."""
    with contextlib.ExitStack() as stack:
        with env(KETCH_API_KEY=KEY):  # for this server's start only: later servers run without a key
            running = stack.enter_context(running_server(
                "--max-running-requests", "2", "--max-queued-requests", "0", "--header-timeout", "6",
                "--body-timeout", "2", "--max-connections", "12"))
        yield running


def authed(base: str, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    return post(base, path, body, {**AUTH, **(headers or {})})


def assert_error(status: int, body: dict, want: int, param: str | None = None, code: str | None = None) -> None:
    assert status == want, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body


def engine_pid(server_pid: int) -> int:
    children = open(f"/proc/{server_pid}/task/{server_pid}/children").read().split()
    engine = [int(p) for p in children if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(engine) == 1, children
    return engine[0]


# ---------------------------------------------------------------- 1: admission slots never leak
LEAKED_SLOT_BEFORE = [  # each raised after admission, while the request was encoded for the engine
    {"prompt": "Hi", "seed": 18446744073709551616},
    {"prompt": "Hi", "top_k": 2 ** 70},
    {"prompt": "Hi", "stop": ["\udfff"]},
]


def test_requests_that_fail_late_release_their_admission_slots(server):
    _, base = server
    for body in LEAKED_SLOT_BEFORE * 2:  # more of them than there are slots
        status, answer = authed(base, CMPL, body)
        assert status == 400, answer
    # both slots are free: two requests at once are admitted (a leaked slot would make one a 429)
    first = open_stream(base, CMPL, {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True}, AUTH)
    status, answer = authed(base, CMPL, {"prompt": "Hi", "max_tokens": 2})
    assert status == 200, answer
    first[0].close()
    wait_for(lambda: pages_all_back(metrics(base, AUTH)), "the dropped stream's pages")


# ---------------------------------------------------------------- 4: bad bodies are JSON 400s, never a bare 500
def _nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


BAD_BODIES = [
    # path, raw body, param
    (CMPL, b'{"prompt": "Hi", "seed": 18446744073709551616}', "seed"),
    (CMPL, b'{"prompt": "Hi", "seed": -9223372036854775809}', "seed"),
    (CMPL, b'{"prompt": "Hi", "seed": 18446744073709551615, "n": 2}', "seed"),
    (CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "top_k": 1180591620717411303424}', "top_k"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    (CMPL, b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
    (CMPL, b'{"prompt": "Hi", "max_tokens": ' + b"7" * 5000 + b"}", None),
    (CMPL, b'{"prompt": "Hi", "temperature": Infinity}', None),
    (CMPL, b'{"prompt": "Hi", "temperature": NaN}', None),
    (CMPL, b'{"prompt": "Hi", "temperature": 1e300}', "temperature"),
    (CMPL, b'{"prompt": "Hi", "temperature": 1e999}', "temperature"),
    (CMPL, json.dumps({"prompt": "Hi", "stop": [f"s{i}" for i in range(10_000)]}).encode(), "stop"),
    (CMPL, b'{"prompt": "Hi", "max_completion_tokens": 3}', "max_completion_tokens"),
    (CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": -5}', "max_completion_tokens"),
    # a misspelt key inside json_schema or a tool was dropped silently, and the constraint with it
    (CHAT, json.dumps({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "shcema": {"type": "integer"}}}}).encode(), "response_format"),
    (CHAT, json.dumps({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": "yes", "schema": {"type": "integer"}}}}).encode(), "response_format"),
    (CHAT, json.dumps({"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "paramaters": {"type": "object"}}}]}).encode(), "tools[0].function.paramaters"),
    (CHAT, json.dumps({"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "strict": "yes"}}]}).encode(), "tools[0].function.strict"),
    ("/tokenize", b'{"prompt": "Hi", "unknown": 1}', "unknown"),
    ("/detokenize", b'{"tokens": [1], "unknown": 1}', "unknown"),
    (CMPL, b'{"prompt": "Hi", "timeout": -1}', "timeout"),
] + [
    (CHAT, json.dumps({"messages": USER, "chat_template_kwargs": {key: "x"}}).encode(), "chat_template_kwargs")
    for key in ("bos_token", "add_generation_prompt", "messages")
] + [(path, _nested(1000), None) for path in POST_ROUTES] + [(path, _nested(100), None) for path in POST_ROUTES]


@pytest.mark.parametrize("path, raw, param", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_bodies_get_a_json_400_naming_the_field(server, path, raw, param):
    _, base = server
    status, body = authed(base, path, raw)
    assert_error(status, body, 400, param)


@pytest.mark.parametrize("json_schema, code", [
    ({"name": "x", "shcema": {"type": "integer"}}, "unsupported_field"),
    ({"name": "x", "strict": "yes", "schema": {"type": "integer"}}, "invalid_type"),
])
def test_json_schema_field_errors_carry_the_codes_of_the_top_level_ones(server, json_schema, code):
    """A misspelt or mistyped key inside response_format.json_schema is coded as the same mistake
    at the top level of the body is (protocol.py: unsupported_field, invalid_type)."""
    rf = {"type": "json_schema", "json_schema": json_schema}
    status, body = authed(server[1], CHAT, {"messages": USER, "response_format": rf})
    assert_error(status, body, 400, "response_format", code)


@pytest.mark.parametrize("extra, param, code", [
    ({"max_completion_tokens": 100000}, "max_completion_tokens", "context_length_exceeded"),  # the engine's check
    ({"max_completion_tokens": 100000, "stream": True}, "max_completion_tokens", "context_length_exceeded"),
    ({"max_completion_tokens": 2, "min_tokens": 5}, "min_tokens", None),  # SamplingParams' check
])
def test_max_completion_tokens_is_named_as_the_client_sent_it(server, extra, param, code):
    """The engine calls it max_tokens; a client that sent max_completion_tokens reads that name."""
    status, body = authed(server[1], CHAT, {"messages": USER, **extra})
    assert_error(status, body, 400, param, code)
    assert "max_completion_tokens" in body["error"]["message"] and "max_tokens" not in body["error"]["message"]


def test_a_non_ascii_authorization_header_is_a_401(server):
    _, base = server
    conn = connect(base)
    conn.putrequest("GET", "/v1/models")
    conn.putheader("authorization", "Bearer sécrèt".encode("latin-1"))
    conn.endheaders()
    resp = conn.getresponse()
    assert_error(resp.status, json.loads(resp.read()), 401, code="invalid_api_key")


def test_the_key_from_the_environment_stays_out_of_the_command_line(server):
    proc, base = server
    assert KEY.encode() not in open(f"/proc/{proc.pid}/cmdline", "rb").read()
    assert post(base, "/tokenize", {"prompt": "Hi"})[0] == 401
    assert authed(base, "/tokenize", {"prompt": "Hi"})[0] == 200


def test_openapi_schema_is_served_behind_the_key(server):
    _, base = server
    conn = connect(base)
    conn.request("GET", "/openapi.json")
    assert conn.getresponse().status == 401
    conn = connect(base)
    conn.request("GET", "/openapi.json", headers=AUTH)
    resp = conn.getresponse()
    schema = json.loads(resp.read())
    assert resp.status == 200
    assert set(POST_ROUTES) <= set(schema["paths"])
    chat = schema["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["required"] == ["messages"] and chat["additionalProperties"] is False
    assert chat["properties"]["n"]["maximum"] == 128


# ---------------------------------------------------------------- 3: non-streaming requests end with their client
def test_a_non_streaming_request_is_aborted_when_its_client_leaves(server):
    _, base = server
    before = metrics(base, AUTH)
    sock = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 + f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(lambda: metrics(base, AUTH)["ketch_generation_tokens_total"] > before["ketch_generation_tokens_total"],
             "the request to start generating")
    sock.close()
    wait_for(lambda: pages_all_back(metrics(base, AUTH)), "the abandoned request's pages")
    after = metrics(base, AUTH)
    aborted = 'ketch_requests_finished_total{finish_reason="abort"}'
    assert after[aborted] - before.get(aborted, 0) == 1
    assert after["ketch_generation_tokens_total"] - before["ketch_generation_tokens_total"] < 1500


# ---------------------------------------------------------------- per-request deadline
def test_a_request_past_its_deadline_is_aborted_with_a_408(server):
    _, base = server
    long = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "timeout": 0.5}
    status, body = authed(base, CMPL, long)
    assert_error(status, body, 408, "timeout", "request_timeout")
    conn, stream = open_stream(base, CMPL, long, AUTH)
    rest = stream.read().decode()
    assert '"code": "request_timeout"' in rest and rest.rstrip().endswith("data: [DONE]")
    wait_for(lambda: pages_all_back(metrics(base, AUTH)), "the timed-out requests' pages")


def test_a_stream_whose_client_stops_reading_still_ends_at_its_deadline():
    """The client never reads (a tiny receive buffer; 16 bf16 samples with 20 logprobs a token fill
    the socket buffers well before the deadline): the server's sends wait for a drain that never comes. At the
    deadline the samples end anyway: the engine stops generating for them and their admission
    slots come back while the socket is still open (they ran on for as long as the client held it)."""
    with running_server("--max-running-requests", "16", "--dtype", "auto") as (_, base):  # bf16: tokens come faster
        body = json.dumps({"prompt": ["Once upon a time", "The history of", "In a galaxy", "Recipe for"], "n": 4,
                           "max_tokens": 3000, "ignore_eos": True, "logprobs": 20, "stream": True,
                           "timeout": 20}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        try:
            sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (CMPL.encode(), len(body), body))
            wait_for(lambda: metrics(base)["ketch_num_requests_running"] == 16, "the samples to run")
            wait_for(lambda: (lambda m: m["ketch_num_requests_running"] == 0 and m["ketch_admitted_sequences"] == 0)(
                metrics(base)), "the deadline to end the samples of the unread stream", deadline_s=90)
        finally:
            sock.close()
        wait_for(lambda: pages_all_back(metrics(base)), "the pages of the stream past its deadline")


# ---------------------------------------------------------------- 7: connection limits
def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


def test_idle_and_slow_connections_are_closed_and_capped(server):
    _, base = server
    port = int(base.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
    slow = idle[0]
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # headers that never end
    over = socket.create_connection(("127.0.0.1", port))  # the 13th: answered 503 at once
    over.settimeout(30)
    resp = http.client.HTTPResponse(over)
    resp.begin()
    assert_error(resp.status, json.loads(resp.read()), 503, code="too_many_connections")
    # --header-timeout 6 (not 2: a pause of this process between the 12 connections and the 13th
    # must not let the server close some first): every one of them is closed by the server
    for sock in idle:
        assert _closed_by_server(sock, within=30)
        sock.close()
    wait_for(lambda: health(base) == 200, "the server to take connections again")


def test_a_body_that_never_arrives_is_a_408(server):
    _, base = server
    sock = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 + f"authorization: Bearer {KEY}\r\ncontent-length: 100\r\n\r\n".encode() + b'{"prompt":')
    sock.settimeout(30)
    resp = http.client.HTTPResponse(sock)  # parses the answer however it is split into packets
    resp.begin()
    assert_error(resp.status, json.loads(resp.read()), 408, code="request_timeout")
    sock.close()


# ---------------------------------------------------------------- 2: n is bounded; aborting many samples is cheap
def test_n_beyond_max_n_is_refused_and_a_huge_n_aborts_in_one_message():
    with running_server("--max-n", "20000", "--max-request-samples", "20000") as (_, base):
        status, body = post(base, CMPL, {"prompt": "Hi", "n": 20001})
        assert_error(status, body, 400, "n")
        # prompts x n past --max-request-samples: refused before any prompt is encoded or queued
        status, body = post(base, CMPL, {"prompt": [[1, 2]] * 10_000, "n": 128, "max_tokens": 1})
        assert_error(status, body, 400, "prompt")
        before = metrics(base)
        for body in ({"prompt": "Hi", "n": 20000}, {"prompt": [[5, 7]] * 200, "n": 100}):
            conn, _ = open_stream(base, CMPL, {**body, "max_tokens": 1000, "ignore_eos": True})
            conn.close()  # 20,000 samples to abort: one message a prompt, O(1) per sample in the engine
            # the engine loop answers again promptly (it took ~88 s when each abort scanned all
            # samples, minutes when each queued sample's removal scanned the queue)
            status, body = post(base, CMPL, {"prompt": "Hi", "max_tokens": 2}, timeout=30)
            assert status == 200, body
            wait_for(lambda: pages_all_back(metrics(base)), "the aborted samples' pages")
        after = metrics(base)
        assert after["ketch_generation_tokens_total"] - before["ketch_generation_tokens_total"] < 200_000  # not 40,000 × 1,000


# ---------------------------------------------------------------- 6: a hung engine: the watchdog
def test_a_hung_engine_fails_requests_and_the_server_exits_nonzero(tmp_path):
    with env(TMPDIR=str(tmp_path)), running_server("--watchdog-timeout", "3") as (proc, base):
        for n in (129, 1_000_000):  # the default --max-n is 128
            status, body = post(base, CMPL, {"prompt": "Hi", "n": n})
            assert_error(status, body, 400, "n")
        assert metrics(base)["ketch_engine_healthy"] == 1
        _, stream = open_stream(base, CMPL, {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True})
        engine = engine_pid(proc.pid)
        os.kill(engine, signal.SIGSTOP)
        try:
            rest = stream.read().decode()  # the watchdog ends the stream: an error event, then [DONE]
            assert '"code": "engine_unavailable"' in rest and rest.rstrip().endswith("data: [DONE]"), rest
            assert "stopped answering" in rest
            assert proc.wait(timeout=60) == 1
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGKILL)
        out = proc.stdout.read()
        assert "no heartbeat" in out, out
    assert list(tmp_path.iterdir()) == []  # the engine's socket directory went with the server


def test_watchdog_verdicts():
    """The verdict from heartbeats alone: silence, or busy without a step, for longer than the timeout."""
    from ketch.server.watchdog import Watchdog

    dog = Watchdog(timeout=3.0, last_beat=0.0)
    dog.beat(1.0, steps=5, busy=True)
    assert dog.verdict(3.9) is None
    dog.beat(3.5, steps=9, busy=True)  # steps move: healthy however long it is busy
    assert dog.verdict(6.0) is None
    dog.beat(6.4, steps=9, busy=True)  # beats, but one step since 3.5
    assert "one step" in dog.verdict(6.6)
    dog.beat(6.8, steps=9, busy=False)  # idle is never stuck
    assert dog.verdict(9.7) is None
    assert "no heartbeat" in dog.verdict(9.9)


def test_an_engine_whose_api_process_died_stops_working():
    """SIGKILL the API process mid-stream: its engine, orphaned with work in hand, exits instead
    of generating for nobody (it checked for its parent only when idle)."""
    with running_server() as (proc, base):
        open_stream(base, CMPL, {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True})
        engine = engine_pid(proc.pid)
        proc.kill()
        proc.wait()
        wait_for(lambda: not os.path.exists(f"/proc/{engine}") or
                 open(f"/proc/{engine}/stat").read().split(") ")[1].startswith("Z"), "the orphaned engine to exit")
