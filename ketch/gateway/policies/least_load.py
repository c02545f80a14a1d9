"""The worker with the least load; among equals the one this policy sent the fewest requests
(idle workers and sequential clients would otherwise all land on the first worker)."""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from ketch.gateway.policies.base import Choice, RoutingPolicy
from ketch.gateway.routed import RoutedRequest
from ketch.gateway.worker import Worker


class LeastLoad(RoutingPolicy):
    name = "least_load"

    def __init__(self) -> None:
        self._sent: Counter[str] = Counter()

    def pick(self, request: RoutedRequest, workers: Sequence[Worker]) -> Choice:
        worker = min(workers, key=lambda w: (w.load, self._sent[w.url]))
        self._sent[worker.url] += 1
        return Choice(worker, self.name)

    def forget(self, url: str) -> None:
        self._sent.pop(url, None)
