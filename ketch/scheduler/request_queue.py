"""The waiting requests, in admission order, with any one removed in O(1).

A deque's `remove` scans: aborting the n samples of many queued prompts (a client that sent
thousands at once and left, or hit its deadline) cost O(n) each, O(n²) in all, and stalled the
engine for minutes. Requests are identity-hashed (Request is eq=False), so an insertion-ordered
dict holds them; `appendleft` (a preempted request, one back from a storage wait) moves one to
the front.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from ketch.scheduler.request import Request


class RequestQueue:
    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[Request, None] = OrderedDict()

    def append(self, req: Request) -> None:
        self._order[req] = None

    def appendleft(self, req: Request) -> None:
        self._order[req] = None
        self._order.move_to_end(req, last=False)

    def remove(self, req: Request) -> None:
        del self._order[req]  # KeyError if it is not queued: a caller's bookkeeping bug

    def __iter__(self) -> Iterator[Request]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __bool__(self) -> bool:
        return bool(self._order)

    def __contains__(self, req: object) -> bool:
        return req in self._order
