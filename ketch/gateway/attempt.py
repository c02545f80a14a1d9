"""One request at one worker: the in-flight count taken once and given back once, and every
outcome charged to the worker's breaker and the gateway's metrics.

What is the worker's fault: not connecting, losing the connection before or during the answer,
timing out, a 5xx. What is not: any answer below 500 (a 4xx is the client's), the client leaving.
"""
from __future__ import annotations

from typing import Callable

from ketch.gateway.metrics import GatewayMetrics
from ketch.gateway.worker import Worker


class Attempt:
    def __init__(self, worker: Worker, route: str, metrics: GatewayMetrics, clock: Callable[[], float]) -> None:
        self.worker, self.metrics, self.clock = worker, metrics, clock
        self._probe = worker.begin(clock())  # the breaker's half-open probe: it must report or give way
        metrics.requests.labels(worker.url, route).inc()
        self._open = True
        self._reported = False

    def answered(self, status: int) -> None:
        """Response headers arrived with `status`."""
        self._reported = True
        self.metrics.responses.labels(self.worker.url, str(status)).inc()
        if status >= 500:
            self.failed("status_5xx")
        else:
            self.worker.breaker.record_success(self.clock())

    def failed(self, kind: str) -> None:
        self._reported = True
        self.metrics.worker_errors.labels(self.worker.url, kind).inc()
        self.worker.breaker.record_failure(self.clock())

    def close(self) -> None:
        if self._open:
            self._open = False
            self.worker.end()
            if self._probe and not self._reported:
                self.worker.breaker.probe_abandoned()
