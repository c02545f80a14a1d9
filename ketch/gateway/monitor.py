"""The gateway's background loops: workers' health, workers' load, and the policy's upkeep.

Each loop sleeps its period between rounds (a period, not a synchronisation) and checks all
workers at once, each check bounded by its timeout, so one hung worker never delays the others'
verdicts. A loop never dies of a worker's error: every failure is that worker's verdict.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

import httpx2 as httpx

from ketch.gateway.config import GatewayConfig
from ketch.gateway.policies import RoutingPolicy
from ketch.gateway.registry import WorkerRegistry
from ketch.gateway.worker import Worker
from ketch.instance_id import HEADER as INSTANCE_HEADER

log = logging.getLogger("ketch.gateway")

LOAD_GAUGES = (b"ketch_num_requests_running", b"ketch_num_requests_waiting")


def queue_length(metrics_text: bytes) -> int:
    """running + waiting sequences from a worker's /metrics; ValueError if either is missing."""
    found = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(b" ")
        if name in LOAD_GAUGES:
            found[name] = float(value)
    if len(found) != len(LOAD_GAUGES):
        raise ValueError(f"/metrics lacks {', '.join(g.decode() for g in LOAD_GAUGES if g not in found)}")
    return int(sum(found.values()))


@dataclass(frozen=True)
class HealthProbe:
    problem: str | None  # None: GET /health answered 200 in time; else what went wrong
    instance: str | None = None  # the server's x-ketch-instance (ketch/instance_id.py), when it sent one


async def probe_health(client: httpx.AsyncClient, worker_url: str, headers: dict[str, str],
                       timeout: float) -> HealthProbe:
    try:
        response = await client.get(worker_url + "/health", headers=headers, timeout=timeout)
    except httpx.TransportError as e:
        return HealthProbe(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    instance = response.headers.get(INSTANCE_HEADER.decode())
    if response.status_code != 200:
        return HealthProbe(f"/health answered {response.status_code}: {response.text[:200]}", instance)
    return HealthProbe(None, instance)


class Monitor:
    def __init__(self, client: httpx.AsyncClient, registry: WorkerRegistry, policy: RoutingPolicy,
                 config: GatewayConfig) -> None:
        self.client, self.registry, self.policy, self.config = client, registry, policy, config
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._every(self.config.health.check_interval_secs, self.check_health)),
                       asyncio.create_task(self._every(self.config.load_interval_secs, self.scrape_load)),
                       asyncio.create_task(self._every(self.config.cache_aware.eviction_interval_secs,
                                                       self._maintain, first_wait=True))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _every(self, period: float, job: Callable[[], Awaitable[None]], first_wait: bool = False) -> None:
        if first_wait:
            await asyncio.sleep(period)
        while True:
            try:
                await job()
            except Exception:  # a bug here must not end health checking for good
                log.exception("gateway background job %s failed", getattr(job, "__name__", job))
            await asyncio.sleep(period)

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.registry.all()))

    async def _check(self, worker: Worker) -> None:
        probe = await probe_health(self.client, worker.url, worker.auth_headers(), self.config.health.check_timeout_secs)
        error = probe.problem
        if probe.instance is not None:  # a worker of --worker-urls learns it here; a restart draws a new one
            if worker.instance is not None and probe.instance != worker.instance:
                self.registry.cache_lost(worker.url)  # restarted: its cache is empty
            worker.instance = probe.instance
        was = worker.health.healthy
        worker.health.record(error is None, error)
        if was != worker.health.healthy:
            log.warning("worker %s is %s%s", worker.url, "healthy" if worker.health.healthy else "unhealthy",
                        f" ({error})" if error else "")

    async def scrape_load(self) -> None:
        await asyncio.gather(*(self._scrape(w) for w in self.registry.all()))

    async def _scrape(self, worker: Worker) -> None:
        try:
            response = await self.client.get(worker.url + "/metrics", headers=worker.auth_headers(),
                                             timeout=self.config.load_timeout_secs)
            response.raise_for_status()
            worker.set_scraped(queue_length(response.content))
        except (httpx.HTTPError, ValueError):
            # no figure: the load falls back to this gateway's in-flight count alone; health and
            # the breaker, not the scrape, decide whether the worker is usable
            worker.external = 0
            worker.scraped = None

    async def _maintain(self) -> None:
        self.policy.maintain()
