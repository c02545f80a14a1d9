"""Buckets of the engine-side TPOT histogram (finished requests' first-to-last-token time in the
engine over their token intervals).

A client judges a server by its *median* TPOT; comparing that with the engine's own median needs
the engine's per-request distribution, not only its mean. Buckets grow by 5 %, so a median read
by interpolation inside one bucket is off by at most 2.5 %, well inside the 10 % a benchmark
compares at; 0.25 ms to ~2.5 s covers a toy model on a GPU to a large one on a laptop CPU.
"""
from __future__ import annotations

import bisect

# upper bounds in seconds, 4 significant digits (readable `le` labels; still 5 % apart)
TPOT_BUCKETS: tuple[float, ...] = tuple(float(f"{0.00025 * 1.05 ** i:.4g}") for i in range(190))


def tpot_bucket(seconds: float) -> int:
    """Index of the first bucket whose upper bound is >= seconds; len(TPOT_BUCKETS) is +Inf."""
    return bisect.bisect_left(TPOT_BUCKETS, seconds)
