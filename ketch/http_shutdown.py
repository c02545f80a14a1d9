"""uvicorn's server as `ketch serve` and `ketch gateway` stop it: SIGTERM / SIGINT start the
graceful shutdown (stop accepting, let open requests finish), requests still open at our
deadline get an answer (`at_deadline`, a subclass's), uvicorn's own deadline comes a little later
(`ANSWER_GRACE_S`) so those answers are written before it cancels the tasks, and the signal ends in
a clean return (exit code 0) instead of being raised again once drained, which would kill the
process before the caller has cleaned up (the engine stopped).
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from typing import Any, Iterator

import uvicorn

ANSWER_GRACE_S = 5.0  # after our deadline, time for the shutdown answers to leave before uvicorn cancels


class GracefulServer(uvicorn.Server):
    # the signals that start the graceful shutdown (a server's extra API processes take only
    # SIGTERM: a terminal's Ctrl-C reaches the whole process group, and a second signal would make
    # uvicorn skip the draining)
    signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, app: Any, deadline_s: float, **config: Any) -> None:
        """`config`: uvicorn.Config's arguments but the graceful shutdown's (`deadline_s` sets it)."""
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=deadline_s + ANSWER_GRACE_S, **config))
        self.deadline_s = deadline_s

    def at_deadline(self) -> None:
        """End what is still open at `deadline_s` after the signal, with an answer."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().call_later(self.deadline_s, self.at_deadline)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in self.signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
