"""Helpers for the server tests: start a real `ketch serve` on loopback, raw HTTP, /metrics parsing."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator
from urllib.parse import urlsplit

STARTUP_DEADLINE_S = 120
# The output files of the processes popen_logged started, until they have ended and a test's
# teardown has passed (conftest prints their tails into a failed test's report).
PROCESS_LOGS: dict[subprocess.Popen, str] = {}


def popen_logged(argv: list[str], **kw) -> subprocess.Popen:
    """Popen with stdout and stderr going to a file, not a pipe: a pipe nobody reads stops a chatty
    server once 64 KiB wait in it, and a failed test can show what the server logged (its 500s say
    only "the server logged the details"). proc.stdout reads the file from its start."""
    fd, path = tempfile.mkstemp(prefix="ketch-test-proc-", suffix=".log")
    with os.fdopen(fd, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True, **kw)
    proc.stdout = open(path, errors="replace")
    PROCESS_LOGS[proc] = path
    return proc


def forget_ended_processes() -> None:
    for proc, path in list(PROCESS_LOGS.items()):
        if proc.poll() is not None:
            del PROCESS_LOGS[proc]
            proc.stdout.close()
            os.unlink(path)


def log_tails(max_chars: int = 6000) -> list[tuple[str, str]]:
    """(the process's command, the end of its output) for each logged process."""
    tails = []
    for proc, path in PROCESS_LOGS.items():
        with open(path, errors="replace") as f:
            text = f.read()
        tails.append((" ".join(map(str, proc.args[1:6])), text[-max_chars:]))
    return tails


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(base: str, timeout: float = 60) -> http.client.HTTPConnection:
    url = urlsplit(base)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)


def health(base: str) -> int | None:
    conn = connect(base, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


@contextlib.contextmanager
def running_server(*extra: str, new_session: bool = False) -> Iterator[tuple[subprocess.Popen, str]]:
    """`ketch serve` on the bundled model (CPU, fp32, one thread) and a free port, healthy on entry;
    new_session: in a process group of its own (its pid is the group's id), as a service manager
    starts it."""
    port = free_port()
    proc = popen_logged(
        # --device cpu: the tests' timing and fp32 assumptions are the CPU's, even on a GPU host
        [sys.executable, "-m", "ketch.cli", "serve", "--port", str(port), "--device", "cpu", "--dtype", "float32",
         "--num-threads", "1", *extra], start_new_session=new_session,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while True:
        assert proc.poll() is None, f"server exited during startup:\n{proc.stdout.read()}"
        if health(base) == 200:
            break
        assert time.monotonic() < deadline, "server not healthy before the deadline"
        time.sleep(0.2)  # polling interval of the health check, not a synchronisation
    try:
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def post(base: str, path: str, body: dict | bytes | str, headers: dict | None = None,
         timeout: float = 60) -> tuple[int, dict]:
    """POST a JSON body (a dict) or raw bytes; returns the status and the parsed JSON answer."""
    status, _, answer = post_with_headers(base, path, body, headers, timeout)
    return status, answer


def post_with_headers(base: str, path: str, body: dict | bytes | str, headers: dict | None = None,
                      timeout: float = 60) -> tuple[int, dict[str, str], dict]:
    """`post`, and the answer's headers (names in lower case)."""
    data = json.dumps(body) if isinstance(body, dict) else body
    conn = connect(base, timeout)
    try:
        conn.request("POST", path, data, {"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read())
    finally:
        conn.close()


def open_stream(base: str, path: str, body: dict,
                headers: dict | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Start a streaming request and read its first SSE event (so the engine has the request)."""
    conn = connect(base)
    conn.request("POST", path, json.dumps({**body, "stream": True}),
                 {"content-type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.readline().startswith(b"data:")
    return conn, resp


def metrics(base: str, headers: dict | None = None) -> dict[str, float]:
    """GET /metrics as {'name{labels}': value} (comments left out)."""
    conn = connect(base)
    try:
        conn.request("GET", "/metrics", headers=headers or {})
        resp = conn.getresponse()
        assert resp.status == 200
        text = resp.read().decode()
    finally:
        conn.close()
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus exposition text as {'name{labels}': value} (comments left out)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def gone(pid: int) -> bool:
    """The process has exited (no such pid, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def pages_all_back(m: dict[str, float]) -> bool:
    """/metrics of an idle engine: no sequence queued or running, every KV page free or in the
    prefix cache, and no reference on a page beyond the cache's own (a leaked one pins a page that
    the page counts still show as cached and evictable)."""
    idle = (m["ketch_num_requests_running"] == 0 and m["ketch_num_requests_waiting"] == 0
            and m["ketch_kv_pages_used"] == 0
            and m["ketch_kv_pages_free"] + m["ketch_kv_pages_cached"] == m["ketch_kv_pages_total"])
    return idle and m["ketch_kv_page_refs_unaccounted"] == 0


def wait_for(condition, what: str, deadline_s: float = 60) -> None:
    """Poll `condition()` until it holds: for effects the server applies on its own (a client's
    disconnect is noticed asynchronously), with a deadline so a broken server fails the test."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
