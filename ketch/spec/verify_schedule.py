"""Confidence-scheduled verify: how many of each sequence's drafted tokens a step verifies, from the
proposer's confidence per position and the measured cost of a step by its number of rows.

A sequence whose draft positions have confidences c_1..c_k yields, if L of them are verified,

    E(L) = 1 + c_1 + c_1 c_2 + ... + c_1 ... c_L     tokens (the 1: the target's own token)

(the draft is kept up to the first rejection; c_i estimates the chance that position i is kept
given that the positions before it were). A step of R rows costs C(R) seconds. The schedule
maximizes the step's expected tokens per second, sum E / C(R): starting from no drafts (R = the
batch size), it adds draft positions in order of their cumulative confidence (a sequence's next
position never beats its previous one, so every sequence's chosen positions stay a prefix) while
the rate grows. With C flat (a step bound by reading the weights) every position with any
confidence goes in; where rows cost (a large batch) only the likely ones do.

C is measured: `VerifyCost` keeps the seconds per decode step by rows (power-of-two buckets, an
exponential moving average), interpolating between measured buckets and flat outside them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ketch.spec.cost_model import bucket, ema


@dataclass
class VerifyCost:
    seconds: dict[int, float] = field(default_factory=dict)  # rows bucket -> seconds per step

    def record(self, rows: int, seconds: float) -> None:
        if rows < 1 or seconds <= 0:
            return
        key = bucket(rows)
        self.seconds[key] = ema(self.seconds.get(key), seconds)

    def __call__(self, rows: int) -> float:
        """Seconds a step of `rows` decode rows is expected to take (1.0 while nothing is measured:
        only ratios matter)."""
        if not self.seconds:
            return 1.0
        keys = sorted(self.seconds)
        if rows <= keys[0]:
            return self.seconds[keys[0]]
        if rows >= keys[-1]:
            return self.seconds[keys[-1]]
        hi = next(k for k in keys if k >= rows)
        lo = max(k for k in keys if k < rows)
        t = (rows - lo) / (hi - lo)
        return self.seconds[lo] + t * (self.seconds[hi] - self.seconds[lo])


def verify_lengths(confidence: np.ndarray, max_draft: list[int], cost: VerifyCost) -> list[int]:
    """confidence: [B, k] per-position confidences in [0, 1]; max_draft: the most positions each
    sequence may verify. Returns how many leading draft positions each sequence verifies."""
    batch, k = confidence.shape
    if batch != len(max_draft):
        raise ValueError(f"max_draft: {len(max_draft)} entries for a batch of {batch}")
    reach = np.cumprod(np.clip(confidence, 0.0, 1.0), axis=1)  # P(position i is kept)
    for b, m in enumerate(max_draft):
        reach[b, max(0, m):] = -1.0  # beyond what the sequence may verify
    order = np.argsort(-reach, axis=None, kind="stable")  # by reach; ties: lower position first
    lengths = [0] * batch
    tokens, rows = float(batch), batch
    rate = tokens / cost(rows)
    for flat in order:
        b, i = divmod(int(flat), k)
        p = float(reach[b, i])
        if p <= 0.0:
            break  # (reach never rises along a draft, ties go to the lower position: i == lengths[b])
        new_rate = (tokens + p) / cost(rows + 1)
        if new_rate < rate:
            break  # reach only falls from here: no later position pays either
        tokens, rows, rate = tokens + p, rows + 1, new_rate
        lengths[b] += 1
    return lengths
