"""The API process's side of the ZMQ link: start the engine process, send requests, route outputs.

One background task reads the engine's output socket and puts each message on the asyncio queue
of the HTTP request that owns its request id. Sends go through a plain (synchronous) PUSH socket
so they can happen anywhere, including a `finally` of a cancelled stream (the abort on disconnect).
Engine death is noticed through the process sentinel (a pipe fd the event loop watches): every
queue gets an EngineGone and `on_death` runs. A hung engine is noticed by the watchdog (see
watchdog.py): the process is killed and the same happens, with the watchdog's reason.

With `--api-server-count N` the first API process starts the engine (`start(api_servers=N)`) and
each other one attaches to it (`attach`): its own pair of sockets, origin k, the same engine. An
attached client is not the engine's parent, so it watches the engine's pid (and its own parent,
the first API process) instead of a sentinel.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import zmq
import zmq.asyncio

from ketch.config import EngineConfig
from ketch.engine import messages as m
from ketch.engine.outputs import EngineStats
from ketch.engine.process import start_engine_process
from ketch.sampling.params import SamplingParams
from ketch.server.watchdog import Watchdog


class EngineGone(Exception):
    """The engine process exited; requests in flight cannot finish."""


class EngineStartError(RuntimeError):
    pass


class EngineSettingError(ValueError):
    """The engine's build refused a setting (its message names it): `ketch serve` exits 2 with it."""


Item = m.TokenDelta | m.RequestError | Exception  # an exception item ends the request with it


class EngineClient:
    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...], watchdog_timeout: float = 300.0,
                 origin: int = 0, workdir: str | None = None) -> None:
        """origin: this API process's index (0: the one that starts the engine); workdir: where the
        ipc sockets live (shared by every API process of a server; None: a fresh one, owned here)."""
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.origin = origin
        self.ready: m.EngineReady | None = None
        self.alive = False
        self.failure: str | None = None  # why the engine is gone (exit code, or the watchdog's verdict)
        self.on_death: Callable[[], None] | None = None
        self.watchdog = Watchdog(watchdog_timeout, time.monotonic())
        self._watch: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._replies: dict[int, asyncio.Future] = {}  # nonce → the Pong's stats or the CacheFlushed
        self._nonces = itertools.count()
        self._owns_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="ketch-")
        self._sync = zmq.Context()
        self._async = zmq.asyncio.Context()
        self._push = self._sync.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the engine drains every step
        self._push.setsockopt(zmq.LINGER, 0)
        self._pull = self._async.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._proc = None
        self._eos_out: Connection | None = None  # launched: where the EOS ids go (hand_eos sends them)
        self._engine_pid: int | None = None  # attached: the engine we did not start
        self._parent_pid: int | None = None  # attached: the API process that started it
        self._router: asyncio.Task | None = None

    @staticmethod
    def addresses(workdir: str, origin: int) -> tuple[str, str]:
        """The ipc input/output addresses of API process `origin`."""
        return f"ipc://{workdir}/input-{origin}", f"ipc://{workdir}/output-{origin}"

    # ---------------------------------------------------------------- lifecycle
    def launch(self, api_servers: int = 1) -> None:
        """Start the engine process (for `api_servers` API processes); it imports its modules until
        `hand_eos` hands it the EOS ids: the caller loads the tokenizer in between."""
        self._link()
        addrs = [self.addresses(self.workdir, k) for k in range(api_servers)]
        self._proc, self._eos_out = start_engine_process(self.config, [a[0] for a in addrs], [a[1] for a in addrs])

    def hand_eos(self, eos_token_ids: tuple[int, ...]) -> None:
        """Hand the launched engine its EOS ids: it builds the engine from here (`start` waits for it)."""
        self.eos_token_ids = eos_token_ids
        try:
            self._eos_out.send(tuple(eos_token_ids))
        except OSError:  # the engine is gone already (BrokenPipeError): it died while importing
            self._proc.join(timeout=5)
            self.close()
            raise EngineStartError(f"the engine process exited during startup (code {self._proc.exitcode})") from None
        finally:
            self._eos_out.close()

    async def start(self, timeout: float = 600.0) -> m.EngineReady:
        """Wait until the engine that `hand_eos` set building is ready."""
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(self._proc.sentinel, lambda: exited.done() or exited.set_result(None))
        msg = await self._first_message(timeout, exited)
        loop.remove_reader(self._proc.sentinel)
        loop.add_reader(self._proc.sentinel, self._on_exit)
        return self._running(msg)

    async def attach(self, engine_pid: int, parent_pid: int, timeout: float = 600.0) -> m.EngineReady:
        """Join the engine another API process started (this one's origin is > 0)."""
        self._link()
        self._engine_pid, self._parent_pid = engine_pid, parent_pid
        return self._running(await self._first_message(timeout, asyncio.get_running_loop().create_future()))

    @property
    def engine_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else self._engine_pid

    def _link(self) -> None:
        """Every PULL binds and every PUSH connects (the engine binds its inbox): a connecting PUSH
        queues a message at once, before the link is up. A binding one has no pipe until the peer's
        handshake lands in ZMQ's I/O thread, and a request sent in that window (EngineReady came first,
        on the other socket; a loaded machine widens it) failed with EAGAIN, a 500 to the client."""
        input_addr, output_addr = self.addresses(self.workdir, self.origin)
        self._pull.bind(output_addr)
        self._push.connect(input_addr)

    async def _first_message(self, timeout: float, exited: asyncio.Future) -> m.EngineReady:
        """EngineReady (heartbeats before it are skipped: an API process that attaches late may get
        the heartbeat thread's first beats before the ready message, which left on another socket)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            first = asyncio.ensure_future(self._pull.recv())
            done, _ = await asyncio.wait([first, exited], timeout=max(0.0, deadline - loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if first not in done:
                first.cancel()
                self.close()
                raise EngineStartError("the engine process exited during startup" if exited.done()
                                       else f"the engine was not ready after {timeout:.0f} s")
            msg = m.decode_from_engine(first.result())
            if isinstance(msg, m.EngineReady):
                return msg
            if not isinstance(msg, m.Heartbeat):
                self.close()
                if isinstance(msg, m.EngineError) and msg.setting:
                    raise EngineSettingError(msg.message)
                raise EngineStartError(getattr(msg, "message", f"unexpected first message {type(msg).__name__}"))

    def _running(self, msg: m.EngineReady) -> m.EngineReady:
        self.ready, self.alive = msg, True
        self.watchdog = Watchdog(self.watchdog.timeout, time.monotonic())
        self._router = asyncio.create_task(self._route())
        self._watch = asyncio.create_task(self._watch_engine())
        return msg

    def close(self) -> None:
        """Ask the engine to stop, then end it; idempotent."""
        if self._eos_out is not None:
            self._eos_out.close()  # an engine still waiting for its EOS ids ends at once
        if self._proc is not None and self._proc.is_alive():
            try:
                self._push.send(m.encode(m.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5)
        for task in (self._router, self._watch):
            if task is not None:
                task.cancel()
        self.alive = False
        if self._owns_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)  # the ipc socket files

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        self._proc.join(timeout=5)  # the sentinel fires before the exit code is collected
        self._gone(f"the engine process exited (code {self._proc.exitcode})")

    def _gone(self, reason: str) -> None:
        """The engine cannot finish anything: every request and ping learns why, once."""
        if not self.alive:
            return
        self.alive, self.failure = False, reason
        self.broadcast(EngineGone(reason))
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(EngineGone(reason))
        if self.on_death is not None:
            self.on_death()

    async def _watch_engine(self) -> None:
        period = min(1.0, self.watchdog.timeout / 4)
        while self.alive:
            await asyncio.sleep(period)  # a timer, not a synchronisation: the verdict reads the clock
            if self._engine_pid is not None and not self._attached_engine_alive():
                return
            verdict = self.watchdog.verdict(time.monotonic())
            if verdict is not None and self.alive:
                print(f"error: {verdict}; killing it", flush=True)
                self._gone(f"the engine stopped answering: {verdict}")
                if self._proc is None:  # attached: the first API process owns the engine; it ends it
                    os.kill(self._engine_pid, 9)
                    return
                self._proc.kill()  # a stopped (SIGSTOP) process dies of SIGKILL too

    def _attached_engine_alive(self) -> bool:
        """Attached: the engine's pid gone (its parent reaps it at once), or our parent gone, ends it."""
        if os.getppid() != self._parent_pid:
            self._gone("the first API process (which started the engine) is gone")
            return False
        try:
            os.kill(self._engine_pid, 0)
        except ProcessLookupError:
            self._gone("the engine process exited")
            return False
        return True

    def healthy(self) -> str | None:
        """None when the engine is up and answering; else why not (for /health)."""
        if not self.alive:
            return self.failure or "the engine is not running"
        return self.watchdog.verdict(time.monotonic())

    def broadcast(self, item: Exception) -> None:
        """End every request in flight with `item` (engine gone, server shutting down)."""
        for queue in self._queues.values():
            queue.put_nowait(item)

    @property
    def exitcode(self) -> int | None:
        return None if self._proc is None else self._proc.exitcode

    # ---------------------------------------------------------------- requests
    @staticmethod
    def encode_request(request_id: str, prompt_ids: list[int], params: SamplingParams, origin: int = 0,
                       generated_token_ids: list[int] | None = None, bootstrap: m.Bootstrap | None = None) -> bytes:
        """The wire form of a request (made before any admission slot is taken: it may raise)."""
        return m.encode(m.GenerateRequest(request_id, prompt_ids, m.WireSamplingParams.from_params(params),
                                          origin, generated_token_ids or [], bootstrap))

    def add(self, request_id: str, message: bytes, queue: asyncio.Queue[Item]) -> None:
        """Send an encoded request; its outputs go to `queue`."""
        if not self.alive:
            raise EngineGone(self.failure or "the engine is not running")
        self._queues[request_id] = queue
        self._push.send(message, zmq.NOBLOCK)

    def abort(self, request_id: str, index: int | None = None) -> None:
        if self.alive:
            self._send(m.AbortRequest(request_id, index))

    def release(self, request_id: str) -> None:
        """The HTTP side is done with this id: later outputs for it are dropped."""
        self._queues.pop(request_id, None)

    async def stats(self, timeout: float) -> EngineStats | None:
        """The engine's stats, or None when it does not answer within `timeout` seconds."""
        return await self._ask(lambda nonce: m.Ping(nonce, self.origin), timeout)

    async def flush_cache(self, timeout: float) -> m.CacheFlushed | None:
        """Empty the engine's prefix cache of every page no running request holds (it does so
        between steps); None when it does not answer within `timeout` seconds."""
        return await self._ask(lambda nonce: m.FlushCache(nonce, self.origin), timeout)

    async def _ask(self, make: Callable[[int], m.ToEngine], timeout: float) -> Any:
        """Send the message `make(nonce)` and wait for the answer with that nonce (None: none came)."""
        if not self.alive:
            return None
        nonce = next(self._nonces)
        fut = self._replies[nonce] = asyncio.get_running_loop().create_future()
        self._send(make(nonce))
        try:
            return await asyncio.wait_for(fut, timeout)
        except (asyncio.TimeoutError, EngineGone):
            return None
        finally:
            self._replies.pop(nonce, None)

    def _send(self, msg: m.ToEngine) -> None:
        self._push.send(m.encode(msg), zmq.NOBLOCK)

    async def _route(self) -> None:
        while True:
            msg = m.decode_from_engine(await self._pull.recv())
            if isinstance(msg, m.TokenOutputs):
                for delta in msg.outputs:
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
            elif isinstance(msg, m.RequestError):
                queue = self._queues.get(msg.request_id)
                if queue is not None:
                    queue.put_nowait(msg)
            elif isinstance(msg, m.Heartbeat):
                self.watchdog.beat(time.monotonic(), msg.steps, msg.busy)
            elif isinstance(msg, (m.Pong, m.CacheFlushed)):
                fut = self._replies.get(msg.nonce)
                if fut is not None and not fut.done():
                    fut.set_result(msg.stats if isinstance(msg, m.Pong) else msg)
            elif isinstance(msg, m.EngineError):
                print(f"engine error: {msg.message}", flush=True)  # the sentinel reports the exit itself


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(12).hex()}"
