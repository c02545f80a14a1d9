"""The composition root of `ketch gateway`: registry, policy, metrics, HTTP client, forwarder and
background monitor, built from one GatewayConfig; `start` / `stop` run inside the event loop."""
from __future__ import annotations

import time

import httpx2 as httpx

from ketch.gateway.config import GatewayConfig
from ketch.gateway.attempt import Attempt
from ketch.gateway.failover import Failover, NoFailover, ResumeFailover
from ketch.gateway.forward import Forwarder
from ketch.gateway.metrics import GatewayMetrics
from ketch.gateway.monitor import Monitor
from ketch.gateway.policies import make_policy
from ketch.gateway.registry import WorkerRegistry
from ketch.gateway.routed import RoutedRequest
from ketch.gateway.worker_url import parse_worker_url

# uvicorn (the workers' server) closes an idle keep-alive connection after 5 s; the pool lets go
# of its own first, or a request could be written onto a socket the worker is closing
_KEEPALIVE_EXPIRY_S = 4.0


class Gateway:
    def __init__(self, config: GatewayConfig, failover: Failover | None = None) -> None:
        self.config = config
        self.clock = time.monotonic
        self.registry = WorkerRegistry(config.breaker, config.health, config.worker_api_key, self.clock)
        for url in config.worker_urls:  # a bad or repeated URL fails the start with a ValueError
            self.registry.add(parse_worker_url(url))
        self.policy = make_policy(config.policy, config.cache_aware)
        self.registry.on_removed.append(self.policy.forget)
        self.metrics = GatewayMetrics(self.registry, self.policy, self.clock)
        if failover is None:
            failover = ResumeFailover(self._continuation, self.metrics, config.retry.attempts) \
                if config.enable_failover else NoFailover()
        self.failover = failover
        self.client: httpx.AsyncClient | None = None
        self.forwarder: Forwarder | None = None
        self.monitor: Monitor | None = None

    async def start(self) -> None:
        c = self.config
        timeout = httpx.Timeout(connect=c.connect_timeout_secs, read=c.request_timeout_secs,
                                write=c.request_timeout_secs, pool=c.connect_timeout_secs)
        # no cap on connections: each worker has its own (--max-connections), and a cap here
        # would queue requests in the gateway where no load figure sees them
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256,
                              keepalive_expiry=_KEEPALIVE_EXPIRY_S)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False, trust_env=False)
        self.forwarder = Forwarder(self.client, self.registry, self.policy, self.metrics, c, self.failover, self.clock)
        self.monitor = Monitor(self.client, self.registry, self.policy, c)
        self.monitor.start()

    async def _continuation(self, request: RoutedRequest, body: bytes,
                            exclude: set[str]) -> tuple[Attempt, httpx.Response] | str:
        assert self.forwarder is not None  # failovers happen only while serving
        return await self.forwarder.continuation(request, body, exclude)

    async def stop(self) -> None:
        if self.monitor is not None:
            await self.monitor.stop()
        if self.client is not None:
            await self.client.aclose()
