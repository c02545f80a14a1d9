"""`ketch serve --api-server-count 2`: two API processes on one port in front of one engine.

Real servers on loopback with the bundled SmolLM2 (fp32, CPU): every answer is what a one-process
server gives, whichever process answered it; /metrics sums what both processes saw, whichever one
a scrape reaches; a killed API process or engine ends the whole server with a message, and
SIGTERM ends it cleanly with no process left behind. Which process answered is read from the
`x-ketch-api-process` header; new connections are spread by the kernel (SO_REUSEPORT), so a test
that needs a given process opens connections until that one answers (bounded).
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import zmq
from gateway_util import request as raw_request
from server_util import connect, gone, open_stream, parse_metrics, post, running_server, wait_for

from ketch.engine import messages as m
from ketch.engine.outboxes import Outboxes
from ketch.server.config import ServerConfig

PROCESS_HEADER = "x-ketch-api-process"
INSTANCE_HEADER = "x-ketch-instance"
MAX_TRIES = 64  # new connections until the kernel hands one to a given process: 2**-64 to fail
DEATH_DEADLINE_S = 10
REQUESTS = [
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 24}),
    ("/v1/completions", {"prompt": "def fibonacci(n):\n", "max_tokens": 24, "stop": ["return"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 24}),
]


def request(base: str, path: str, body: dict, stream: bool = True) -> tuple[int, dict]:
    """One request on a new connection: (the API process that answered, what it answered: the joined
    text of every choice, the finish reasons and the usage)."""
    conn = connect(base)
    try:
        usage = {"stream_options": {"include_usage": True}} if stream else {}
        conn.request("POST", path, json.dumps({**body, "temperature": 0, "stream": stream, **usage}),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        process = int(resp.getheader(PROCESS_HEADER, "-1"))  # -1: a one-process server (no header)
        if not stream:
            answer = json.loads(resp.read())
            choice = answer["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            return process, {"text": text, "finish": [choice["finish_reason"]], "usage": answer["usage"]}
        text, finish, usage = [], [], None
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
                if choice.get("finish_reason"):
                    finish.append(choice["finish_reason"])
        return process, {"text": "".join(text), "finish": finish, "usage": usage}
    finally:
        conn.close()


def without_cache_hits(answer: dict) -> dict:
    """The answer less its prefix-cache hit count (a repeated prompt hits the cache: that is the
    point of the cache, not a difference in the answer)."""
    usage = {k: v for k, v in answer["usage"].items() if k != "prompt_tokens_details"}
    return {**answer, "usage": usage}


def answered_by(base: str, want: int, path: str, body: dict, stream: bool = True, sent: list | None = None) -> dict:
    """The answer of API process `want` (requests on new connections until it answers one; each
    request sent is appended to `sent`)."""
    for _ in range(MAX_TRIES):
        process, answer = request(base, path, body, stream)
        if sent is not None:
            sent.append(process)
        if process == want:
            return answer
    raise AssertionError(f"API process {want} never answered in {MAX_TRIES} connections")


def scrape(base: str) -> tuple[int, dict[str, float]]:
    conn = connect(base)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200
        process, text = int(resp.getheader(PROCESS_HEADER)), resp.read().decode()
    finally:
        conn.close()
    return process, parse_metrics(text)


def all_listening(port: int, count: int) -> set[int]:
    """The API processes' pids once `count` of them listen: /health answers as soon as the first
    does, while the others may still be starting (SO_REUSEPORT gives them no connection before)."""
    wait_for(lambda: len(listeners(port)) >= count, f"{count} API processes listening on {port}")
    return listeners(port)


def listeners(port: int) -> set[int]:
    """The pids holding a listening TCP socket on `port` (the API processes)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                    inodes.add(f"socket:[{cols[9]}]")
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                pids.add(int(pid))
        except OSError:
            continue  # exited while we looked, or not ours
    return pids


def children(pid: int) -> set[int]:
    out = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(entry))
        except OSError:
            continue
    return out


def wait_gone(pids: set[int], what: str) -> None:
    deadline = time.monotonic() + DEATH_DEADLINE_S
    while not all(gone(p) for p in pids):
        assert time.monotonic() < deadline, f"{what} outlived the server"
        time.sleep(0.1)  # polling interval, not a synchronisation


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def two():
    with running_server("--api-server-count", "2") as server:
        yield server


@pytest.fixture(scope="module")
def one():
    with running_server() as server:
        yield server


def test_every_answer_is_the_one_process_servers_whichever_process_gives_it(one, two):
    (_, base1), (_, base2) = one, two
    for path, body in REQUESTS:
        for stream in (True, False):
            _, want = request(base1, path, body, stream)
            assert want["text"] and want["usage"], want
            for process in (0, 1):
                got = answered_by(base2, process, path, body, stream)
                assert without_cache_hits(got) == without_cache_hits(want), (path, body, stream, process)


def test_both_processes_name_one_server_and_another_server_another(one, two):
    """x-ketch-instance (ketch/instance_id.py): the engine's id on every answer, whichever API
    process gives it; another server has its own (the gateway refuses a server it has already)."""
    seen: dict[int, set[str]] = {0: set(), 1: set()}
    for _ in range(MAX_TRIES):
        _, headers, _ = raw_request(two[1], "GET", "/health")
        seen[int(headers[PROCESS_HEADER])].add(headers[INSTANCE_HEADER])
        if seen[0] and seen[1]:
            break
    assert seen[0] == seen[1] and len(seen[0]) == 1, seen
    (instance,) = seen[0]
    other = raw_request(one[1], "GET", "/v1/models")[1][INSTANCE_HEADER]
    assert len(instance) == len(other) == 32 and other != instance


API_SIDE = ('ketch_requests_finished_total{finish_reason="length"}', "ketch_time_to_first_token_seconds_count",
            "ketch_e2e_request_latency_seconds_count")


def test_metrics_sum_both_processes_whichever_one_is_scraped(two):
    _, base = two
    before = {p: scrape_from(base, p) for p in (0, 1)}
    for name in API_SIDE:  # both processes report the same sums (requests of earlier tests included)
        assert before[0].get(name, 0) == before[1].get(name, 0), name
    body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    sent: list[int] = []
    for process in (0, 1):  # until each has answered one, so neither process alone saw them all
        answered_by(base, process, "/v1/completions", body, sent=sent)
    assert set(sent) == {0, 1}
    for p in (0, 1):
        after = scrape_from(base, p)
        for name in API_SIDE:
            assert after[name] - before[p].get(name, 0) == len(sent), (p, name, after[name], sent)
        assert after["ketch_engine_healthy"] == 1 and after["ketch_admitted_sequences"] == 0


def scrape_from(base: str, want: int) -> dict[str, float]:
    for _ in range(MAX_TRIES):
        process, values = scrape(base)
        if process == want:
            return values
    raise AssertionError(f"API process {want} never answered /metrics in {MAX_TRIES} connections")


def test_sigterm_ends_every_process_cleanly():
    with running_server("--api-server-count", "2") as (server, base):
        apis = all_listening(port_of(base), 2)
        assert len(apis) == 2 and server.pid in apis, apis
        everyone = children(server.pid) | apis
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, server.stdout.read()
        wait_gone(everyone, "an API or engine process")


def test_sigterm_stops_every_api_process_at_once():
    """A stream open on process 0 keeps its drain going (--shutdown-timeout 30); the other process
    stops accepting at once too, instead of taking new requests until process 0's drain ended
    (and only then starting its own: two deadlines)."""
    with running_server("--api-server-count", "2", "--shutdown-timeout", "30") as (server, base):
        for _ in range(MAX_TRIES):  # a long stream on process 0
            conn, stream = open_stream(base, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4000,
                                                                 "ignore_eos": True})
            if stream.getheader(PROCESS_HEADER) == "0":
                break
            conn.close()
        else:
            raise AssertionError("process 0 never took the stream")
        server.send_signal(signal.SIGTERM)

        def refused() -> bool:  # a new request is turned away (503) or finds no listener
            try:
                return post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, timeout=10)[0] == 503
            except OSError:
                return True

        wait_for(refused, "every API process to stop taking requests", deadline_s=20)
        conn.close()
        assert server.wait(timeout=60) == 0


def test_sigterm_to_the_whole_process_group_drains_cleanly():
    """systemd (KillMode=control-group) and `kill -TERM -PGID` signal every process of the server,
    the engine too: the engine leaves its end to the API process, so a stream in flight still
    finishes and the server exits 0, as after a SIGTERM to the API process alone."""
    with running_server(new_session=True) as (server, base):
        everyone = children(server.pid) | {server.pid}
        conn, stream = open_stream(base, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24,
                                                             "ignore_eos": True, "temperature": 0})
        os.killpg(server.pid, signal.SIGTERM)
        rest = stream.read().decode()
        conn.close()
        assert '"finish_reason": "length"' in rest and rest.rstrip().endswith("data: [DONE]"), rest[-300:]
        assert server.wait(timeout=60) == 0
        out = server.stdout.read()
        assert "shut down" in out and "engine process exited" not in out, out[-500:]
        wait_gone(everyone, "a server process")


def test_a_killed_api_process_ends_the_server_naming_it():
    with running_server("--api-server-count", "2") as (server, base):
        engine, worker = engine_and_worker(server, port_of(base))
        os.kill(worker, signal.SIGKILL)
        assert server.wait(timeout=DEATH_DEADLINE_S) == 1
        assert "API process ketch-api-1 exited (code -9)" in server.stdout.read()
        wait_gone({engine}, "the engine")


def test_a_killed_engine_ends_every_api_process():
    with running_server("--api-server-count", "2") as (server, base):
        engine, worker = engine_and_worker(server, port_of(base))
        os.kill(engine, signal.SIGKILL)
        assert server.wait(timeout=DEATH_DEADLINE_S) == 1
        assert "the engine process exited" in server.stdout.read()
        wait_gone({worker}, "API process 1")


def engine_and_worker(server, port: int) -> tuple[int, int]:
    """The engine and the second API process: the server's spawned children, told apart by the
    listening socket only the API process holds."""
    spawned = {p for p in children(server.pid) if b"spawn_main" in _cmdline(p)}
    [worker] = all_listening(port, 2) - {server.pid}
    [engine] = spawned - {worker}
    return engine, worker


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_outputs_go_back_to_the_process_that_sent_the_request(tmp_path):
    """Outboxes on real ZMQ sockets: each API process gets its requests' deltas, one message per
    step; a finished request is forgotten."""
    zctx = zmq.Context()
    pulls = [zctx.socket(zmq.PULL) for _ in range(2)]
    for k, sock in enumerate(pulls):
        sock.bind(f"ipc://{tmp_path}/out-{k}")
    boxes = Outboxes.connect(zctx, [f"ipc://{tmp_path}/out-{k}" for k in range(2)])
    try:
        boxes.owned("a", 0)
        boxes.owned("b", 1)
        boxes.owned("c", 1)
        delta = lambda rid, done: m.TokenDelta(rid, 0, [7], None, done, "length" if done else None, None, 3, 0)
        boxes.send_outputs([delta("a", False), delta("b", True), delta("c", False)], live={"a", "c"})
        got = [m.decode_from_engine(sock.recv()) for sock in pulls]
        assert [[d.request_id for d in msg.outputs] for msg in got] == [["a"], ["b", "c"]]
        assert boxes._owner == {"a": 0, "c": 1}  # b finished: forgotten
        boxes.forget_unless({"a"})
        assert boxes._owner == {"a": 0}
        for sock in pulls:
            assert not sock.poll(0)  # one message each, nothing else
    finally:
        boxes.close()
        for sock in pulls:
            sock.close(linger=0)
        zctx.term()


def test_api_server_count_is_checked():
    with pytest.raises(ValueError, match="api_server_count"):
        ServerConfig(api_server_count=0)
