"""Two workers drawn at random, the less loaded one wins: near least-load balance without every
gateway (or every burst) piling onto the same idle worker."""
from __future__ import annotations

import random
from typing import Sequence

from ketch.gateway.policies.base import Choice, RoutingPolicy
from ketch.gateway.routed import RoutedRequest
from ketch.gateway.worker import Worker


class PowerOfTwo(RoutingPolicy):
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, request: RoutedRequest, workers: Sequence[Worker]) -> Choice:
        if len(workers) == 1:
            return Choice(workers[0], self.name)
        a, b = self._rng.sample(list(workers), 2)
        return Choice(b if b.load < a.load else a, self.name)
