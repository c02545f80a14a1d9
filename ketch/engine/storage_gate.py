"""The storage gate (scheduler/gate.py): a request whose prompt goes past the cached prefix waits
here while its pages are read from L3 (cache/storage_tier.py), at most until its deadline
(`hicache_prefetch_timeout`), then goes in with whatever arrived (best effort).

    add ─▶ kv.prefetch(prompt) ─▶ park ──read done, or deadline──▶ kv.settle_prefetch (adopt; the prefix stays pinned) ─▶ queue ─▶ admit (unpin)
                                  └─ abort ─▶ forget (the read is cancelled, the prefix unpinned)

Adoption runs here, on the engine thread, at the moment the gate opens: the tree is only ever
touched by that thread. Storage never fails a request: a dead store, a miss, a rejected page only
mean fewer cached tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ketch.cache.manager import KVCacheManager
from ketch.cache.storage_tier import Prefetch
from ketch.scheduler.request import Request


@dataclass
class _Parked:
    samples: list[Request]
    job: Prefetch


class StorageGate:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.parked: list[_Parked] = []

    def park(self, samples: list[Request], job: Prefetch) -> None:
        self.parked.append(_Parked(list(samples), job))  # a copy: forget() edits it

    def release(self) -> list[tuple[list[Request], Exception | None]]:
        now = time.monotonic()
        ready = [p for p in self.parked if p.job.done.is_set() or now >= p.job.deadline]
        if not ready:
            return []
        gone = {id(p) for p in ready}
        self.parked = [p for p in self.parked if id(p) not in gone]
        stats = self.kv.storage.stats  # type: ignore[union-attr]
        for p in ready:
            p.job.cancelled = True
            stats.prefetches += 1
            stats.prefetch_timeouts += not p.job.done.is_set()
            stats.prefetch_wait_seconds += now - p.job.started
            self.kv.settle_prefetch(p.job)
            for req in p.samples:
                req.pin = p.job  # admission (or the end of the request) unpins the prefix
        return [(p.samples, None) for p in ready]

    def has_parked(self) -> bool:
        return bool(self.parked)

    def wait(self, timeout: float) -> None:
        """An otherwise idle engine sleeps until the first read ends or its deadline comes."""
        if self.parked:
            first = min(self.parked, key=lambda p: p.job.deadline)
            first.job.done.wait(max(0.0, min(timeout, first.job.deadline - time.monotonic())))

    def forget(self, req: Request) -> None:
        for p in self.parked:
            if req in p.samples:
                p.samples.remove(req)
                if not p.samples:
                    p.job.cancelled = True
                    self.kv.unpin(p.job)
        self.parked = [p for p in self.parked if p.samples]
