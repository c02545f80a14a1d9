"""The timing the CPU kernel benchmarks share: a few warm-up calls, then the best of `rounds`
rounds of `calls` calls (the least disturbed by the rest of the machine), in seconds a call."""
from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], calls: int = 20, rounds: int = 3, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best
