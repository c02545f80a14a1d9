"""A real redis-server for the L3 Redis tests: started on a free loopback port as a pure cache (no
persistence, a small maxmemory, allkeys-lru), killed, stopped and continued, and restarted on the
same port. `redis_server` is the fixture; tests skip, saying why, where redis-server is missing
(scripts/setup.sh --test installs it with apt-get)."""
from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

START_DEADLINE_S = 10.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
MAXMEMORY = "4mb"
SKIP_REASON = ("redis-server is not on PATH: `bash scripts/setup.sh --test` installs it "
               "(apt-get install redis-server)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: Linux kills it when the test process dies (a pytest killed by a
    timeout runs no fixture teardown, and a server left behind would hold its port)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class RedisServer:
    """One redis-server process at a time on `port`, its files (log, none else) under `workdir`."""

    def __init__(self, workdir: Path, maxmemory: str = MAXMEMORY) -> None:
        self.workdir, self.maxmemory = workdir, maxmemory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def raw(self) -> redis.Redis:
        """A plain client of this server, for looking behind the backend's back."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> None:
        assert self.proc is None, "already running"
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
                "--dir", str(self.workdir), "--logfile", "", "--daemonize", "no"]
        log = open(self.workdir / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                     preexec_fn=_die_with_parent)
        log.close()  # the child has its own copy
        self._wait_until_it_answers()

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """End the process (SIGKILL: no goodbye to the clients; SIGTERM: a clean shutdown)."""
        assert self.proc is not None, "not running"
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=START_DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """A fresh, empty server on the same port (a clean stop first if one is running)."""
        if self.proc is not None:
            self.resume()  # a stopped process would not act on SIGTERM
            self.kill(signal.SIGTERM)
        self.start()

    def _wait_until_it_answers(self) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + START_DEADLINE_S
        try:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log_tail()}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer PING in {START_DEADLINE_S} s: {self.log_tail()}")
                time.sleep(0.02)  # a poll interval, not a wait for something to have happened
        finally:
            client.close()

    def log_tail(self) -> str:
        path = self.workdir / f"redis-{self.port}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else "(no log)"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.resume()
            server.kill()
