"""`--api-server-count N`: the N - 1 API processes beyond the first, on the same port.

    ketch serve (API process 0) ── starts ──▶ engine process (N input sockets, N output sockets)
          │                                        ▲
          └── starts ──▶ API processes 1..N-1 ─────┘ each attaches with its own pair (origin k)

Every API process binds its own listening socket to the one port with SO_REUSEPORT, and the
kernel spreads new connections over them; a connection stays with the process that accepted it.
Each has its own tokenizer, detokenizers, event loop and engine client, so the per-token work of
N sets of streams runs on N cores while the engine batches them all.

Lifecycle: the first API process supervises. It waits for every worker's "ready" before it says
it is serving; a worker that dies takes the server down (exit 1, like the engine dying); on
shutdown it sends SIGTERM to each worker (each drains its own streams, like the first one) and
kills what is left after the deadline. A worker ends itself when its parent or the engine is gone
(its engine client watches both pids).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection, wait
from typing import Callable

from ketch.config import EngineConfig
from ketch.server.config import ServerConfig

READY_TIMEOUT_S = 600.0  # a worker loads its tokenizer and attaches to a ready engine: seconds, normally


class ApiWorkerError(RuntimeError):
    pass


def bound_socket(host: str, port: int, shared: bool) -> socket.socket:
    """A TCP socket bound to (host, port), before the model loads: a port in use or a bad host is
    an error naming `port` at once, not after the load. `shared`: other processes of this user
    may bind it too (SO_REUSEPORT: the API processes of one server)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        field = "host" if isinstance(e, socket.gaierror) else "port"  # a name that does not resolve
        raise ValueError(f"{field}: cannot bind {host}:{port} ({e.strerror})") from None
    return sock


def start_listening(sock: socket.socket, host: str, port: int, backlog: int) -> None:
    """listen() on the socket bound before the model loaded. Bound but not listening, the port is
    free for another SO_REUSEADDR socket to bind and listen on meanwhile (the prefill engine's own
    bootstrap socket, given the same port; another server starting beside): then this listen()
    fails, and uvloop's create_server ignores that, so the server announced itself and answered
    nothing. Called before the announcement: a ValueError naming `port` (exit 2)."""
    try:
        sock.listen(backlog)
    except OSError as e:
        raise ValueError(f"port: cannot listen on {host}:{port} ({e.strerror}): another socket took it while the "
                         f"model loaded") from None


def shared_metrics_dir(workdir: str) -> str:
    """The directory the API processes keep their metric values in (set before any of them starts)."""
    path = os.path.join(workdir, "metrics")
    os.makedirs(path, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # inherited by the workers spawned after this
    return path


class ApiWorkers:
    def __init__(self, procs: list[multiprocessing.Process], conns: list[Connection]) -> None:
        self.procs, self._conns = procs, conns
        self.failure: str | None = None
        self.on_death: Callable[[str], None] | None = None
        self._stopping = False

    @classmethod
    def start(cls, config: EngineConfig, sc: ServerConfig, workdir: str, engine_pid: int, port: int) -> "ApiWorkers":
        ctx = multiprocessing.get_context("spawn")
        procs, conns = [], []
        for origin in range(1, sc.api_server_count):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=run_api_worker, name=f"ketch-api-{origin}", daemon=True,
                               args=(config, sc, origin, workdir, engine_pid, os.getpid(), port, child_end))
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        return cls(procs, conns)

    async def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Every worker said "ready"; raises ApiWorkerError when one failed, died or took too long."""
        pending = dict(zip(self._conns, self.procs, strict=True))
        deadline = asyncio.get_running_loop().time() + timeout
        while pending:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise ApiWorkerError(f"{len(pending)} API process(es) not ready after {timeout:.0f} s")
            ready = await asyncio.to_thread(wait, [*pending, *(p.sentinel for p in pending.values())], left)
            for conn in [c for c in pending if c in ready or pending[c].sentinel in ready]:
                proc = pending.pop(conn)
                word = conn.recv() if conn.poll() else f"exited (code {proc.exitcode})"
                if word != "ready":
                    raise ApiWorkerError(f"API process {proc.name}: {word}")
        loop = asyncio.get_running_loop()
        for proc in self.procs:
            loop.add_reader(proc.sentinel, self._died, proc)

    def _died(self, proc: multiprocessing.Process) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        if self._stopping or self.failure is not None:
            return
        proc.join(timeout=5)
        self.failure = f"API process {proc.name} exited (code {proc.exitcode})"
        print(f"error: {self.failure}; stopping the server", file=sys.stderr, flush=True)
        if self.on_death is not None:
            self.on_death(self.failure)

    def signal_stop(self) -> None:
        """SIGTERM every worker once: each stops accepting and drains its streams, alongside the
        first process's drain (not after it: new requests would land on them meanwhile, and the
        shutdown would take two deadlines)."""
        if self._stopping:
            return
        self._stopping = True
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    def stop(self, timeout: float) -> None:
        """signal_stop, then kill what is left after `timeout`."""
        self.signal_stop()
        for proc in self.procs:
            proc.join(timeout=timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def run_api_worker(config: EngineConfig, sc: ServerConfig, origin: int, workdir: str, engine_pid: int,
                   parent_pid: int, port: int, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the first API process's to handle (it SIGTERMs us)
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    sys.exit(run(_serve_worker(config, sc, origin, workdir, engine_pid, parent_pid, port, conn)))


async def _serve_worker(config: EngineConfig, sc: ServerConfig, origin: int, workdir: str, engine_pid: int,
                        parent_pid: int, port: int, conn: Connection) -> int:
    from ketch.server.client import EngineClient, EngineStartError
    from ketch.server.http_server import http_server
    from ketch.server.serve import load_tokenizer

    try:
        sock = bound_socket(sc.host, port, shared=True)
        tokenizer = load_tokenizer(config)
        client = EngineClient(config, tokenizer.eos_token_ids if tokenizer else (), sc.watchdog_timeout,
                              origin=origin, workdir=workdir)
        await client.attach(engine_pid, parent_pid, READY_TIMEOUT_S)
    except (EngineStartError, ValueError, OSError) as e:
        conn.send(f"{type(e).__name__}: {e}")
        return 1
    server = http_server(config, sc, client, tokenizer, os.path.join(workdir, "metrics"))
    server.signals = (signal.SIGTERM,)
    conn.send("ready")
    try:
        await server.serve(sockets=[sock])
    finally:
        client.close()
    return 1 if client.failure is not None else 0
