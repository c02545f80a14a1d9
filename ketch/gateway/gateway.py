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
from ketch.gateway.pd import PDForwarder
from ketch.gateway.policies import make_policy
from ketch.gateway.registry import WorkerRegistry
from ketch.gateway.routed import RoutedRequest
from ketch.gateway.worker_url import parse_worker_url

from ketch.gateway.upstream import KEEPALIVE_S, Answer, Upstream


class Gateway:
    def __init__(self, config: GatewayConfig, failover: Failover | None = None) -> None:
        self.config = config
        self.clock = time.monotonic
        self.registry = WorkerRegistry(config.breaker, config.health, config.worker_api_key, self.clock)
        # a bad or repeated URL (a worker cannot be both prefill and decode) fails the start: ValueError
        for url in config.worker_urls:
            self.registry.add(parse_worker_url(url))
        for prefill in config.prefill_workers:
            self.registry.add(parse_worker_url(prefill.url), "prefill", prefill.bootstrap_port)
        for url in config.decode_urls:
            self.registry.add(parse_worker_url(url), "decode")
        self.policy = make_policy(config.policy, config.cache_aware)
        self.registry.on_removed.append(self.policy.forget)
        self.metrics = GatewayMetrics(self.registry, self.policy, self.clock)
        if failover is None:  # PD mode: none (pd.py says why)
            failover = ResumeFailover(self._continuation, self.metrics, config.retry.attempts) \
                if config.enable_failover and not config.pd_disaggregation else NoFailover()
        self.failover = failover
        self.client: httpx.AsyncClient | None = None  # the monitor's (health checks, load scrapes)
        self.upstream: Upstream | None = None  # the requests' (forward.py)
        self.forwarder: Forwarder | None = None
        self.pd: PDForwarder | None = None  # PD mode's generation requests
        self.monitor: Monitor | None = None

    async def start(self) -> None:
        c = self.config
        timeout = httpx.Timeout(connect=c.connect_timeout_secs, read=c.request_timeout_secs,
                                write=c.request_timeout_secs, pool=c.connect_timeout_secs)
        # the monitor's: a health check and a scrape at a time per worker
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32, keepalive_expiry=KEEPALIVE_S)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False, trust_env=False)
        # the requests': no cap on connections (each worker has its own --max-connections, and a
        # cap here would queue requests in the gateway where no load figure sees them)
        self.upstream = Upstream(c.connect_timeout_secs, c.request_timeout_secs)
        # PD mode: the plain routes (GET /v1/models) go to a decode worker, generation to a pair
        self.forwarder = Forwarder(self.upstream, self.registry, self.policy, self.metrics, c, self.failover, self.clock,
                                   role="decode" if c.pd_disaggregation else None)
        if c.pd_disaggregation:
            self.pd = PDForwarder(self.forwarder, self.upstream, self.registry, self.policy, self.metrics, self.clock)
        self.monitor = Monitor(self.client, self.registry, self.policy, c)
        self.monitor.start()

    async def _continuation(self, request: RoutedRequest, body: bytes,
                            exclude: set[str]) -> tuple[Attempt, Answer] | str:
        assert self.forwarder is not None  # failovers happen only while serving
        return await self.forwarder.continuation(request, body, exclude)

    @property
    def responder(self) -> Forwarder | PDForwarder:
        """What answers generation requests (generate.py)."""
        assert self.forwarder is not None  # the lifespan started the gateway before any request
        return self.pd or self.forwarder

    async def stop(self) -> None:
        if self.pd is not None:
            await self.pd.stop()
        if self.monitor is not None:
            await self.monitor.stop()
        if self.client is not None:
            await self.client.aclose()
        if self.upstream is not None:
            self.upstream.close()
