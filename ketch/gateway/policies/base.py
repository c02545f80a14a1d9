"""The routing contract: `pick(request, workers) -> Choice`.

`workers` is never empty and holds only workers a request may go to now (healthy, breaker not
open, not tried yet by this request), so a policy cannot send a request to a dead worker however
attractive its cache is. A policy may learn from what it picks (the cache-aware trees); `forget`
tells it a worker left, `maintain` runs periodically (eviction).

The choice carries why it was made, for the gateway's /metrics (routing decisions by reason, the
cache-aware match ratio); ARCHITECTURE.md's `pick -> worker` grew that much.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ketch.gateway.routed import RoutedRequest
from ketch.gateway.worker import Worker


@dataclass(frozen=True)
class Choice:
    worker: Worker
    reason: str  # round_robin | least_load | power_of_two | cache_hit | smallest_tree | balance
    match_ratio: float | None = None  # cache_aware: the best prefix match over the text's length
    # what the pick taught the policy, taken back when the worker did not take the request (a 4xx
    # or 5xx, or no answer): it cached nothing of it (cache_aware: the text its tree gained)
    unlearn: Callable[[], object] | None = field(default=None, compare=False)


class RoutingPolicy(ABC):
    name: str

    @abstractmethod
    def pick(self, request: RoutedRequest, workers: Sequence[Worker]) -> Choice: ...

    def forget(self, url: str) -> None:
        """The worker left the gateway."""

    def maintain(self) -> None:
        """Periodic upkeep (every --eviction-interval-secs)."""

    def tree_sizes(self) -> dict[str, int]:
        """Per worker, the characters its policy state holds (cache_aware only)."""
        return {}
