"""Each request to the next worker in turn."""
from __future__ import annotations

from typing import Sequence

from ketch.gateway.policies.base import Choice, RoutingPolicy
from ketch.gateway.routed import RoutedRequest
from ketch.gateway.worker import Worker


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, request: RoutedRequest, workers: Sequence[Worker]) -> Choice:
        # modulo the current list: workers joining or leaving shift the turn, they never break it
        worker = workers[self._turn % len(workers)]
        self._turn += 1
        return Choice(worker, self.name)
