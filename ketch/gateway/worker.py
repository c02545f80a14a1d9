"""One worker (a `ketch serve` process) as the gateway sees it: its address and key, breaker,
health, and load.

Load = the requests this gateway has in flight there + what the worker itself reported beyond
them at the last scrape of its /metrics (running + waiting sequences). A scrape counts this
gateway's own requests too, so they are taken out once (`external`), and the in-flight part stays
exact between scrapes; what other clients send the worker directly shows up through `external`.
"""
from __future__ import annotations

from typing import Any

from ketch.gateway.breaker import BreakerState, CircuitBreaker
from ketch.gateway.config import BreakerConfig, HealthConfig
from ketch.gateway.worker_url import WorkerAddress


class HealthTracker:
    """Healthy until `failure_threshold` failed checks in a row; healthy again after
    `success_threshold` good ones in a row."""

    def __init__(self, config: HealthConfig, healthy: bool = True) -> None:
        self.config, self.healthy = config, healthy
        self._fails = self._oks = 0
        self.last_error: str | None = None

    def record(self, ok: bool, error: str | None = None) -> None:
        if ok:
            self._fails, self._oks = 0, self._oks + 1
            if not self.healthy and self._oks >= self.config.success_threshold:
                self.healthy = True
            self.last_error = None
        else:
            self._oks, self._fails = 0, self._fails + 1
            if self.healthy and self._fails >= self.config.failure_threshold:
                self.healthy = False
            self.last_error = error


class Worker:
    def __init__(self, address: WorkerAddress, api_key: str | None, breaker: BreakerConfig,
                 health: HealthConfig, role: str = "normal", bootstrap_port: int | None = None) -> None:
        self.url = address.url
        self.role = role  # normal | prefill | decode (PD mode, pd.py)
        self.bootstrap_port = bootstrap_port  # a prefill worker's KV bootstrap server
        self.api_key = api_key  # the URL's own key, else the gateway's --worker-api-key
        self.breaker = CircuitBreaker(breaker)
        self.health = HealthTracker(health)
        self.in_flight = 0
        self.external = 0  # sequences the worker reported beyond this gateway's in-flight requests
        self.scraped: int | None = None  # running + waiting at the last good scrape
        self.instance: str | None = None  # which server it is (x-ketch-instance), once a probe saw it

    @property
    def load(self) -> int:
        return self.in_flight + self.external

    def available(self, now: float) -> bool:
        return self.health.healthy and self.breaker.allows(now)

    def begin(self, now: float) -> bool:
        """A request leaves for this worker (paired with one `end`); True when it is the breaker's
        half-open probe."""
        self.in_flight += 1
        return self.breaker.dispatched(now)

    def end(self) -> None:
        self.in_flight -= 1

    def set_scraped(self, running_and_waiting: int) -> None:
        self.scraped = running_and_waiting
        self.external = max(0, running_and_waiting - self.in_flight)

    def auth_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def request_headers(self, request_id: str | None = None) -> dict[str, str]:
        """A forwarded request's headers: a JSON body, no compression, this worker's key, and the
        client's request id (ketch/request_id.py) where there is one."""
        headers = {"content-type": "application/json", "accept-encoding": "identity", **self.auth_headers()}
        if request_id is not None:
            headers["x-request-id"] = request_id
        return headers

    def describe(self, now: float) -> dict[str, Any]:
        """GET /workers: one worker's state (never its key)."""
        state = self.breaker.state(now) if self.breaker.config.enabled else BreakerState.CLOSED
        described = {"url": self.url, "role": self.role, "available": self.available(now), "healthy": self.health.healthy,
                "breaker": state.name.lower(), "in_flight": self.in_flight, "load": self.load,
                "scraped_load": self.scraped, "last_health_error": self.health.last_error, "instance": self.instance}
        if self.bootstrap_port is not None:
            described["bootstrap_port"] = self.bootstrap_port
        return described
