"""The API process's side of the ZMQ link: start the engine process, send requests, route outputs.

One background task reads the engine's output socket and puts each message on the asyncio queue
of the HTTP request that owns its request id. Sends go through a plain (synchronous) PUSH socket
so they can happen anywhere, including a `finally` of a cancelled stream (the abort on disconnect).
Engine death is noticed through the process sentinel (a pipe fd the event loop watches): every
queue gets an EngineGone and `on_death` runs. A hung engine is noticed by the watchdog (see
watchdog.py): the process is killed and the same happens, with the watchdog's reason.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import time
from typing import Callable

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


Item = m.TokenDelta | m.RequestError | Exception  # an exception item ends the request with it


class EngineClient:
    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...], watchdog_timeout: float = 300.0) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.ready: m.EngineReady | None = None
        self.alive = False
        self.failure: str | None = None  # why the engine is gone (exit code, or the watchdog's verdict)
        self.on_death: Callable[[], None] | None = None
        self.watchdog = Watchdog(watchdog_timeout, time.monotonic())
        self._watch: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._pongs: dict[int, asyncio.Future[EngineStats]] = {}
        self._nonces = itertools.count()
        self._dir = tempfile.mkdtemp(prefix="ketch-")
        self._sync = zmq.Context()
        self._async = zmq.asyncio.Context()
        self._push = self._sync.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the engine drains every step
        self._push.setsockopt(zmq.LINGER, 0)
        self._pull = self._async.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._proc = None
        self._router: asyncio.Task | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self, timeout: float = 600.0) -> m.EngineReady:
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._push.bind(input_addr)
        self._pull.bind(output_addr)
        self._proc = start_engine_process(self.config, self.eos_token_ids, input_addr, output_addr)
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(self._proc.sentinel, lambda: exited.done() or exited.set_result(None))
        first = asyncio.ensure_future(self._pull.recv())
        done, _ = await asyncio.wait([first, exited], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if first not in done:
            first.cancel()
            self.close()
            raise EngineStartError("the engine process exited during startup" if exited.done()
                                   else f"the engine was not ready after {timeout:.0f} s")
        msg = m.decode_from_engine(first.result())
        if not isinstance(msg, m.EngineReady):
            self.close()
            raise EngineStartError(getattr(msg, "message", f"unexpected first message {type(msg).__name__}"))
        loop.remove_reader(self._proc.sentinel)
        loop.add_reader(self._proc.sentinel, self._on_exit)
        self.ready, self.alive = msg, True
        self.watchdog = Watchdog(self.watchdog.timeout, time.monotonic())
        self._router = asyncio.create_task(self._route())
        self._watch = asyncio.create_task(self._watch_engine())
        return msg

    def close(self) -> None:
        """Ask the engine to stop, then end it; idempotent."""
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
        shutil.rmtree(self._dir, ignore_errors=True)  # the ipc socket files

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
        for fut in self._pongs.values():
            if not fut.done():
                fut.set_exception(EngineGone(reason))
        if self.on_death is not None:
            self.on_death()

    async def _watch_engine(self) -> None:
        period = min(1.0, self.watchdog.timeout / 4)
        while self.alive:
            await asyncio.sleep(period)  # a timer, not a synchronisation: the verdict reads the clock
            verdict = self.watchdog.verdict(time.monotonic())
            if verdict is not None and self.alive:
                print(f"error: {verdict}; killing it", flush=True)
                self._gone(f"the engine stopped answering: {verdict}")
                self._proc.kill()  # a stopped (SIGSTOP) process dies of SIGKILL too

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
    def encode_request(request_id: str, prompt_ids: list[int], params: SamplingParams) -> bytes:
        """The wire form of a request (made before any admission slot is taken: it may raise)."""
        return m.encode(m.GenerateRequest(request_id, prompt_ids, m.WireSamplingParams.from_params(params)))

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
        if not self.alive:
            return None
        nonce = next(self._nonces)
        fut = self._pongs[nonce] = asyncio.get_running_loop().create_future()
        self._send(m.Ping(nonce))
        try:
            return await asyncio.wait_for(fut, timeout)
        except (asyncio.TimeoutError, EngineGone):
            return None
        finally:
            self._pongs.pop(nonce, None)

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
            elif isinstance(msg, m.Pong):
                fut = self._pongs.get(msg.nonce)
                if fut is not None and not fut.done():
                    fut.set_result(msg.stats)
            elif isinstance(msg, m.EngineError):
                print(f"engine error: {msg.message}", flush=True)  # the sentinel reports the exit itself


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(12).hex()}"
