"""A circuit breaker per worker, fed by the outcomes of real requests.

    CLOSED ──failure_threshold failures in a row──▶ OPEN ──timeout_duration_secs──▶ HALF_OPEN
       ▲                                              ▲                                 │
       └──────── success_threshold successes ─────────┼──── any failure ◀───────────────┘
                 (one probe request at a time)

What counts: connection errors, timeouts, 5xx and a stream cut short are failures; any answer
below 500 is a success, 4xx included: a 400 is the client's fault and proves the worker alive
(breakers that counted 4xx emptied whole fleets: PRIOR_ART.md, known failure 10).

Time is passed in (`now`, seconds from any monotonic clock), so the state machine is tested
without waiting.
"""
from __future__ import annotations

import enum

from ketch.gateway.config import BreakerConfig


class BreakerState(enum.IntEnum):
    # the values are the /metrics gauge ketch_gateway_worker_breaker_state
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self._state = BreakerState.CLOSED
        self._failures = 0  # in a row, while closed
        self._successes = 0  # in a row, while half-open
        self._opened_at = 0.0
        self._probing = False  # a half-open probe is out and has not reported yet
        self.times_opened = 0

    def state(self, now: float) -> BreakerState:
        if self._state is BreakerState.OPEN and now - self._opened_at >= self.config.timeout_duration_secs:
            self._state, self._successes, self._probing = BreakerState.HALF_OPEN, 0, False
        return self._state

    def allows(self, now: float) -> bool:
        """May a request go to this worker now? Half-open: only while no probe is out."""
        if not self.config.enabled:
            return True
        state = self.state(now)
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._probing)

    def dispatched(self, now: float) -> bool:
        """A request was sent; when half-open it is the probe, and the next waits for its outcome.
        True when it is the probe."""
        if self.state(now) is BreakerState.HALF_OPEN:
            self._probing = True
            return True
        return False

    def probe_abandoned(self) -> None:
        """The probe ended with no outcome (its client left before the worker answered): nothing
        was learned, so the next request probes. Without this the breaker stayed half-open with
        its one probe slot taken, and the worker was shut out until the gateway restarted."""
        self._probing = False

    def record_success(self, now: float) -> None:
        state = self.state(now)
        self._probing = False
        if state is BreakerState.HALF_OPEN:
            self._successes += 1
            if self._successes >= self.config.success_threshold:
                self._state, self._failures = BreakerState.CLOSED, 0
        elif state is BreakerState.CLOSED:
            self._failures = 0

    def record_failure(self, now: float) -> None:
        state = self.state(now)
        self._probing = False
        if state is BreakerState.HALF_OPEN:
            self._open(now)
        elif state is BreakerState.CLOSED:
            self._failures += 1
            if self._failures >= self.config.failure_threshold:
                self._open(now)
        # OPEN: a late outcome of a request sent before it opened changes nothing

    def _open(self, now: float) -> None:
        self._state, self._opened_at, self._failures, self._successes = BreakerState.OPEN, now, 0, 0
        self.times_opened += 1
