"""Helpers for the gateway tests: real `ketch serve` replicas and a real `ketch gateway`, all on
loopback, started as processes and stopped (or SIGKILLed) by the tests."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterator

from server_util import STARTUP_DEADLINE_S, connect, free_port, health, popen_logged

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Replica:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_replica(port: int, *extra: str) -> Replica:
    """`ketch serve` on `port` (CPU, fp32, one thread, like server_util.running_server), not waited for."""
    proc = popen_logged(
        [sys.executable, "-m", "ketch.cli", "serve", "--port", str(port), "--device", "cpu", "--dtype", "float32",
         "--num-threads", "1", *extra])
    return Replica(proc, port)


def wait_healthy(replica: Replica, deadline_s: float = STARTUP_DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while health(replica.url) != 200:
        assert replica.proc.poll() is None, f"replica exited during startup:\n{replica.proc.stdout.read()}"
        assert time.monotonic() < deadline, "replica not healthy before the deadline"
        time.sleep(0.2)  # polling interval, not a synchronisation


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def replicas(n: int, *extra: str) -> Iterator[list[Replica]]:
    """n replicas started together (their start-ups overlap), all healthy on entry."""
    started = [start_replica(free_port(), *extra) for _ in range(n)]
    try:
        for r in started:
            wait_healthy(r)
        yield started
    finally:
        for r in started:
            stop(r.proc)


@contextlib.contextmanager
def running_gateway(*args: str, env: dict | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """`ketch gateway` on a free port; on entry it answers HTTP (its /health may be 503: no worker)."""
    port = free_port()
    proc = popen_logged([sys.executable, "-m", "ketch.cli", "gateway", "--port", str(port), *args], env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while health(base) is None:
            assert proc.poll() is None, f"gateway exited during startup:\n{proc.stdout.read()}"
            assert time.monotonic() < deadline, "gateway not answering before the deadline"
            time.sleep(0.1)  # polling interval, not a synchronisation
        yield proc, base
    finally:
        stop(proc)


def request(base: str, method: str, path: str, body: dict | bytes | None = None,
            headers: dict | None = None, timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP exchange: status, headers (lower-case names), body bytes."""
    conn = connect(base, timeout)
    try:
        data = json.dumps(body) if isinstance(body, dict) else body
        conn.request(method, path, data, {"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def workers(base: str, headers: dict | None = None) -> dict[str, dict]:
    """GET /workers as {url: state}."""
    status, _, body = request(base, "GET", "/workers", headers=headers)
    assert status == 200, body
    return {w["url"]: w for w in json.loads(body)["workers"]}


def sigkill_replica(replica: Replica) -> None:
    """SIGKILL the replica's API process and its engine process: the machine lost the worker."""
    pid = replica.proc.pid
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    replica.proc.kill()
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(child), signal.SIGKILL)
    replica.proc.wait()
