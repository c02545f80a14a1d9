"""The workers behind the gateway, keyed by canonical URL; they join and leave at run time.

Everything runs on the gateway's one event loop, so there are no locks: a removed worker's
in-flight requests finish on the Worker object they hold, it is just never picked again.
"""
from __future__ import annotations

import time
from typing import Callable, Collection

from ketch.gateway.config import BreakerConfig, HealthConfig
from ketch.gateway.worker import Worker
from ketch.gateway.worker_url import WorkerAddress


class DuplicateWorker(ValueError):
    pass


class WorkerRegistry:
    def __init__(self, breaker: BreakerConfig, health: HealthConfig, default_api_key: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.breaker, self.health, self.default_api_key, self.clock = breaker, health, default_api_key, clock
        self._workers: dict[str, Worker] = {}
        # a worker left, or its server restarted (cache_lost): e.g. the cache-aware policy drops its tree
        self.on_removed: list[Callable[[str], None]] = []

    def add(self, address: WorkerAddress, role: str = "normal", bootstrap_port: int | None = None,
            instance: str | None = None) -> Worker:
        """instance: the server's x-ketch-instance as a probe saw it; a server registered already
        under another address (localhost vs 127.0.0.1, a name vs its IP) is refused as well."""
        if address.url in self._workers:
            raise DuplicateWorker(f"worker {address.url} is already registered")
        same = next((w for w in self._workers.values() if instance is not None and w.instance == instance), None)
        if same is not None:
            raise DuplicateWorker(f"worker {address.url} is the server registered already as {same.url} "
                                  f"(the same x-ketch-instance)")
        worker = Worker(address, address.api_key or self.default_api_key, self.breaker, self.health, role,
                        bootstrap_port)
        worker.instance = instance
        self._workers[address.url] = worker
        return worker

    def remove(self, url: str) -> Worker:
        """KeyError if there is no such worker."""
        worker = self._workers.pop(url)
        for callback in self.on_removed:
            callback(url)
        return worker

    def cache_lost(self, url: str) -> None:
        """The worker's server restarted (a new x-ketch-instance): what was learnt of its cache is void."""
        for callback in self.on_removed:
            callback(url)

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def available(self, exclude: frozenset[str] | set[str] = frozenset(), role: str | None = None) -> list[Worker]:
        """Healthy workers (of `role`, if given) whose breaker lets a request through, in the order
        they joined."""
        now = self.clock()
        return [w for w in self._workers.values()
                if w.url not in exclude and (role is None or w.role == role) and w.available(now)]

    def states(self, roles: Collection[str] | None = None) -> str:
        """Why requests find no worker (of `roles`, if given): each one's health and breaker, and
        what its last failed health check met."""
        now = self.clock()
        return ", ".join(f"{w.url} ({'healthy' if w.health.healthy else 'unhealthy'}, breaker "
                         f"{w.breaker.state(now).name.lower()}"
                         f"{': ' + w.health.last_error if w.health.last_error else ''})"
                         for w in self._workers.values() if roles is None or w.role in roles)
