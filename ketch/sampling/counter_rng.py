"""The sampler's randomness: one uniform number per sampled token, a pure function of
(the sample's seed, the token's index in the output).

A stateful generator per request (advanced once per token in this process) cannot be continued
elsewhere: a stream resumed on another worker after k tokens would draw the first token's number
again. Here token k of a sample always draws `token_uniform(seed, k)`, wherever and whenever it
is sampled, so a resumed request (engine README, "Resuming a stream") continues the original's
draws exactly, and a preempted or recomputed one too. It costs a few integer operations on the
host per sampled row and step, and the numbers travel to the device with the row's other knobs.

The mixing is splitmix64's (Steele, Lea, Flood 2014): the seed is mixed into a stream state, and
output k is the mix of state + (k + 1) * golden ratio, i.e. splitmix64's k-th number from that state.
"""
from __future__ import annotations

import os

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_UNIT = 2.0**-53


def fresh_seed() -> int:
    """63 bits of OS randomness: the seed of a request that brought none."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def _mix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def token_uniform(seed: int, index: int) -> float:
    """A uniform number in (0, 1) for output token `index` of the sample seeded `seed`.

    52 random bits as an odd multiple of 2**-53: exact in a float64, never 0 or 1 (an inverse-CDF
    draw at exactly 0 or 1 would land on an edge token whatever its probability)."""
    state = _mix64(seed & _MASK64)
    bits = _mix64((state + (index + 1) * _GOLDEN) & _MASK64)
    return ((bits >> 12) * 2 + 1) * _UNIT
