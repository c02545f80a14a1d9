"""Speculate only while it pays: measured verify steps against measured plain decode steps.

Per batch-size bucket (powers of two) the engine records each decode step's wall time and how
many tokens it yielded per sequence. A verify step is worth it when it yields more tokens per
second than a plain step:

    tokens_per_seq(verify) / seconds(verify)  >=  1 / seconds(plain)

Both sides are exponential moving averages of what this engine measured on this machine: the
verify cost grows with k and the batch (at bs 64 a verify step of k = 4 is 5 rows per sequence,
no longer free), and the acceptance depends on the workload. Unknowns are measured first: a
bucket speculates until it has a verify figure, then runs one plain step for the other; a bucket
that turned speculation off probes it again every PROBE_EVERY steps (the workload may change),
and one that has it on re-measures a plain step every REFRESH_EVERY steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

EMA_WEIGHT = 0.2  # of the newest measurement
PROBE_EVERY = 8
REFRESH_EVERY = 256


def bucket(batch_size: int) -> int:
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class _Bucket:
    plain_s: float | None = None  # seconds of a plain decode step
    verify_s: float | None = None  # seconds of a verify step
    verify_tokens: float | None = None  # tokens a verify step yielded per sequence
    since_switch: int = 0  # steps since the last probe or refresh


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


@dataclass
class SpecCostModel:
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    plain_steps: int = 0  # steps it chose to run without drafts (to measure them, or as speculation lost)

    def should_speculate(self, batch_size: int) -> bool:
        b = self.buckets.setdefault(bucket(batch_size), _Bucket())
        b.since_switch += 1
        if b.verify_s is None:
            return True
        if b.plain_s is None:
            return self._plain(b)
        if self.pays(batch_size):
            return b.since_switch % REFRESH_EVERY != 0 or self._plain(b)
        return b.since_switch % PROBE_EVERY == 0 or self._plain(b)

    def _plain(self, b: _Bucket) -> bool:
        self.plain_steps += 1
        return False

    def pays(self, batch_size: int) -> bool:
        """Do the figures so far favour speculating at this batch size? (True while unknown)"""
        b = self.buckets.get(bucket(batch_size))
        if b is None or None in (b.plain_s, b.verify_s, b.verify_tokens):
            return True
        return b.verify_tokens / b.verify_s >= 1.0 / b.plain_s

    def record(self, batch_size: int, seconds: float, tokens_per_seq: float, verified: bool) -> None:
        """A decode step (no prompt chunk in it) took `seconds` and yielded `tokens_per_seq`."""
        b = self.buckets.setdefault(bucket(batch_size), _Bucket())
        if verified:
            b.verify_s = _ema(b.verify_s, seconds)
            b.verify_tokens = _ema(b.verify_tokens, tokens_per_seq)
        else:
            b.plain_s = _ema(b.plain_s, seconds)


class AlwaysSpeculate:
    """--speculative-adaptive off: every decode step asks for drafts, whatever it costs."""

    plain_steps = 0

    def should_speculate(self, batch_size: int) -> bool:
        return True

    def record(self, batch_size: int, seconds: float, tokens_per_seq: float, verified: bool) -> None:
        pass
