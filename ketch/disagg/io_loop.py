"""The background thread of a tcp transport: one per process side, owning every socket.

ZMQ sockets are not thread-safe, so the engine thread never touches one: an API call (init,
send, abort) puts a command on a queue and writes a byte to a pipe the loop polls beside its
sockets, so the loop wakes at once instead of spinning. The loop also wakes every `tick_s` for
heartbeats and deadlines. If the loop dies on an unexpected exception, every open room fails with
the reason instead of waiting for its timeout.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import zmq

from ketch.disagg.state import TransferState

log = logging.getLogger(__name__)


def tcp_endpoint(host: str, port: int | str | None = None) -> str:
    """A ZMQ tcp endpoint: an IPv6 address in brackets (`tcp://[::1]:5757`; a host given bracketed
    or not), a name or IPv4 address as it is."""
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    where = f"[{host}]" if ":" in host else host
    return f"tcp://{where}" if port is None else f"tcp://{where}:{port}"


_BUSY_POLL_MS = 1.0  # how often pump() checks operations in flight (nixl READs) that no socket reports


class IOLoop:
    def __init__(self, name: str, tick_s: float) -> None:
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.IPV6, 1)  # every socket of this loop: IPv6 addresses too (IPv4 as before)
        self.poller = zmq.Poller()
        self.tick_s = tick_s
        self._commands: queue.SimpleQueue[tuple[Callable[..., None], tuple]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._stopping = False
        self._states_lock = threading.Lock()
        self._states: set[TransferState] = set()  # every open room's state: fail_all reaches them all
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def call(self, fn: Callable[..., None], *args: object) -> bool:
        """Run fn(*args) on the loop's thread, soon (from any thread). False: the loop has ended
        (closed or crashed) and will never run it."""
        if not self.alive:
            return False
        self._commands.put((fn, args))
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full: the loop has wake-ups pending already
            pass
        return True

    def discard(self) -> None:
        """A loop whose owner failed before start(): its context and pipe freed."""
        self.ctx.destroy(linger=0)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._wake_r = self._wake_w = -1

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the loop (its rooms fail) and free the pipe once the thread is gone."""
        self.call(self._set_stopping)
        self._thread.join(timeout_s)
        if not self._thread.is_alive() and self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def track(self, state: TransferState) -> None:
        """Count a new room's state as open (call before handing the room to the loop)."""
        with self._states_lock:
            self._states.add(state)

    def prune(self) -> None:
        """Forget the rooms that are over (on the loop's tick)."""
        with self._states_lock:
            self._states = {s for s in self._states if not s.terminal}

    def fail_all(self, reason: str) -> None:
        """Fail every open room (the loop has ended: nothing will move their bytes any more)."""
        with self._states_lock:
            states = list(self._states)
        for state in states:
            with state.lock:
                state.fail(reason)

    def _set_stopping(self) -> None:
        self._stopping = True

    # ------------------------------------------------------------ what a side implements
    def on_ready(self, ready: dict) -> None:
        """Handle the sockets poll found readable."""
        raise NotImplementedError

    def pump(self) -> None:
        """Send what may be sent now (data chunks under their window); check operations in flight."""

    def busy(self) -> bool:
        """Whether an operation in flight needs pump() soon although no socket will wake the loop."""
        return False

    def on_tick(self, now: float) -> None:
        """Heartbeats, deadlines, silent peers."""
        raise NotImplementedError

    def close_sockets(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ the loop
    def _run(self) -> None:
        reason = "transport closed"
        try:
            next_tick = time.monotonic()
            while not self._stopping:
                timeout_ms = max(0.0, next_tick - time.monotonic()) * 1000
                if self.busy():
                    timeout_ms = min(timeout_ms, _BUSY_POLL_MS)
                ready = dict(self.poller.poll(timeout_ms))
                if self._wake_r in ready:
                    ready.pop(self._wake_r)
                    _drain(self._wake_r)
                while not self._commands.empty():
                    fn, args = self._commands.get_nowait()
                    fn(*args)
                if ready:
                    self.on_ready(ready)
                self.pump()
                now = time.monotonic()
                if now >= next_tick:
                    self.on_tick(now)
                    next_tick = now + self.tick_s
        except Exception as e:  # noqa: BLE001 - every room must learn that its transport is gone
            log.exception("disagg transport thread %s crashed", self._thread.name)
            reason = f"transport thread crashed: {e!r}"
        finally:
            self._stopping = True  # first: a call() from now on is refused, and its room failed by the caller
            self.fail_all(reason)
            self.close_sockets()
            self.ctx.term()


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
