"""Speculate only while it pays: measured blocks of speculating steps against blocks of plain ones.

Per batch-size bucket (powers of two) the engine runs decode steps in blocks of BLOCK_STEPS, each
block in one mode: speculating (drafts asked for; each step processed before the next is
scheduled) or plain (no drafts; steps overlap). A block's rate is the tokens it yielded per
sequence over its wall time, launch of its first step to launch of the next block's first: a
whole block, so that what overlap moves across a step boundary stays inside it. Speculation
continues while its rate is at least the plain rate:

    tokens_per_seq(speculating) / seconds(speculating)  >=  tokens_per_seq(plain) / seconds(plain)

Both sides are exponential moving averages of what this engine measured on this machine: the
verify cost grows with k and the batch (at bs 64 a verify of k = 4 is 320 decode rows, no longer
free), the lost overlap costs a few percent, and the acceptance depends on the workload. Unknowns
are measured first (a speculating block, then a plain one); a bucket that turned speculation off
probes it after PROBE_EVERY blocks, and each probe that finds it still losing doubles the wait (up
to MAX_PROBE_EVERY). The wait is also never shorter than what keeps the probes' measured cost
within PROBE_BUDGET of the time between them: a probe block that runs `loss` blocks' time longer
than a plain one (loss = plain rate / speculating rate - 1: at bs 64 a verify of k = 4 with no
draft kept is ~4) waits loss / PROBE_BUDGET blocks (80), up to MAX_PROBE_WAIT. One that has
it on re-measures a plain block every REFRESH_EVERY. A block that a prompt chunk or a batch-size change interrupts is dropped; the step
after a full block closes it (a verify's tokens are counted when it is processed, just before
that launch) and is measured by no block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

EMA_WEIGHT = 0.3  # of the newest block
BLOCK_STEPS = 8
PROBE_EVERY = 4  # blocks: the first probe after speculation turned off ...
MAX_PROBE_EVERY = 64  # ... each probe that finds it still losing doubles the wait, up to this
PROBE_BUDGET = 0.05  # the probes' extra time, at most this share of the plain time between them ...
MAX_PROBE_WAIT = 512  # ... as long as that wait (blocks) is at most this
REFRESH_EVERY = 16  # blocks


def bucket(batch_size: int) -> int:
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # speculating? -> tokens per seq per second
    blocks: int = 0  # blocks closed since the favoured mode last changed or was last probed
    probe_every: int = PROBE_EVERY  # while speculation loses: blocks between probes


@dataclass
class _Block:
    bucket: int
    speculating: bool
    started: float  # launch time of its first step
    batch_size: int
    steps: int = 0
    tokens: int = 0


def ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


@dataclass
class SpecCostModel:
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    plain_steps: int = 0  # decode steps run without drafts by its choice
    _block: _Block | None = None

    def should_speculate(self, batch_size: int) -> bool:
        """The mode of the step about to launch: its block's (a full block's too: that step only
        closes it, at its launch, once the block's last tokens are in), else the next block's."""
        blk = self._block
        speculating = blk.speculating if blk is not None and blk.bucket == bucket(batch_size) \
            else self._next_mode(bucket(batch_size))
        self.plain_steps += not speculating
        return speculating

    def pays(self, batch_size: int) -> bool:
        """Do the figures so far favour speculating at this batch size? (True while unknown)"""
        b = self.buckets.get(bucket(batch_size))
        if b is None or len(b.rate) < 2:
            return True
        return b.rate[True] >= b.rate[False]

    def _next_mode(self, key: int) -> bool:
        b = self.buckets.setdefault(key, _Bucket())
        if True not in b.rate:
            return True
        if False not in b.rate:
            return False
        favoured = b.rate[True] >= b.rate[False]
        every = REFRESH_EVERY if favoured else b.probe_every
        return favoured if b.blocks < every else not favoured

    def launched(self, now: float, batch_size: int, decode_only: bool, speculating: bool) -> None:
        """A step was launched in the mode should_speculate gave (prompt chunks: decode_only False)."""
        blk, key = self._block, bucket(batch_size)
        if blk is not None and blk.steps >= BLOCK_STEPS:
            self._close(blk, now)  # this step ends the full block and is measured by none
            self._block = None
            return
        if blk is not None and (blk.bucket, blk.batch_size, blk.speculating) != (key, batch_size, speculating):
            blk = self._block = None  # interrupted: dropped
        if not decode_only:
            self._block = None
            return
        if blk is None:
            blk = self._block = _Block(key, speculating, now, batch_size)
        blk.steps += 1

    def yielded(self, tokens: int) -> None:
        """Tokens the open block's steps produced (a plain step: one per sequence)."""
        if self._block is not None:
            self._block.tokens += tokens

    def idle(self) -> None:
        self._block = None  # a wait would count as the block's time

    def _close(self, blk: _Block, now: float) -> None:
        if now <= blk.started:
            return
        b = self.buckets.setdefault(blk.bucket, _Bucket())
        known = len(b.rate) == 2
        favoured_before = not known or b.rate[True] >= b.rate[False]
        b.rate[blk.speculating] = ema(b.rate.get(blk.speculating), blk.tokens / blk.batch_size / (now - blk.started))
        favoured = len(b.rate) < 2 or b.rate[True] >= b.rate[False]
        if favoured != favoured_before or not known:
            b.blocks, b.probe_every = 0, _affordable_wait(b, PROBE_EVERY)
        elif blk.speculating != favoured:  # a probe (or refresh) that changed nothing: wait longer to probe again
            b.blocks = 0
            if not favoured:
                b.probe_every = _affordable_wait(b, min(2 * b.probe_every, MAX_PROBE_EVERY))
        else:
            b.blocks += 1


def _affordable_wait(b: _Bucket, wait: int) -> int:
    """`wait` blocks between probes, or more where a probe's measured extra time would exceed
    PROBE_BUDGET of the plain time between them."""
    if len(b.rate) < 2 or b.rate[True] >= b.rate[False] or b.rate[True] <= 0:
        return wait
    loss = b.rate[False] / b.rate[True] - 1  # a probe block's extra time, in plain blocks
    return max(wait, min(MAX_PROBE_WAIT, math.ceil(loss / PROBE_BUDGET)))


class AlwaysSpeculate:
    """--speculative-adaptive off: every decode step asks for drafts, whatever it costs."""

    plain_steps = 0

    def should_speculate(self, batch_size: int) -> bool:
        return True

    def launched(self, now: float, batch_size: int, decode_only: bool, speculating: bool) -> None:
        pass

    def yielded(self, tokens: int) -> None:
        pass

    def idle(self) -> None:
        pass
