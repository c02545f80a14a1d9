"""The API process's verdict on the engine process, from the engine's own heartbeats.

The engine's heartbeat thread says every HEARTBEAT_S "alive, `steps` steps so far, busy or not".
The engine is hung when no beat came for `timeout` seconds (the process is frozen: SIGSTOP, a
lock held forever, swapped out) or when it has been busy for `timeout` seconds without finishing
a step (the step loop is stuck: a device that never returns). A slow /health ping between two
long steps is not a verdict: the heartbeat does not wait for the loop.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Watchdog:
    timeout: float
    last_beat: float  # time.monotonic() of the last heartbeat (or of start-up)
    steps: int = -1
    progress_at: float = 0.0  # when the step count last moved (or the engine was last idle)

    def __post_init__(self) -> None:
        self.progress_at = self.last_beat

    def beat(self, now: float, steps: int, busy: bool) -> None:
        self.last_beat = now
        if steps != self.steps or not busy:
            self.steps, self.progress_at = steps, now

    def verdict(self, now: float) -> str | None:
        """None while the engine is healthy; else why it is declared hung."""
        silent = now - self.last_beat
        if silent > self.timeout:
            return f"the engine process sent no heartbeat for {silent:.1f} s (--watchdog-timeout {self.timeout:g})"
        stuck = now - self.progress_at
        if stuck > self.timeout:
            return f"the engine has been in one step for {stuck:.1f} s (--watchdog-timeout {self.timeout:g})"
        return None

    def age(self, now: float) -> float:
        return now - self.last_beat
