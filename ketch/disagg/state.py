"""The state of one transfer (one bootstrap room), as the scheduler sees it through `poll()`.

    Bootstrapping ──▶ WaitingForInput ──▶ Transferring ──▶ Success
          └────────────────┴──────────────────┴──────────▶ Failed (with a reason)

Bootstrapping: the two sides have not found each other yet (the decode side has not registered
the room, or the bootstrap server has not answered). WaitingForInput: they have; the sender waits
for the engine's `send`, the receiver for the first bytes. Transferring: bytes move. Success and
Failed are terminal and sticky: a late message never revives a room.

Transitions happen on the transport's background thread (or inside an API call such as `abort`),
under `lock`; `poll` reads one attribute without the lock (a single reference read is atomic
under the GIL), so the scheduler loop never waits on the network. Whoever writes into or reads
from a room's pages holds `lock` and checks `terminal` first: after `fail` returns, no byte of
the room's pages is touched again (the scheduler may free them at once).
"""
from __future__ import annotations

import enum
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ketch.disagg.config import DisaggConfig


class KVPoll(enum.IntEnum):
    # SGLang's numbering (Failed first), so logs and metrics read the same across the two
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


_ORDER = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success)


class TransferState:
    """One room's state, its failure reason and the deadline of the state it is in."""

    def __init__(self, timeouts: dict[KVPoll, float]) -> None:
        """timeouts: seconds allowed in each non-terminal state (a missing state: no limit)."""
        self.lock = threading.Lock()
        self._timeouts = timeouts
        self.state = KVPoll.Bootstrapping
        self.reason: str | None = None
        self.deadline = self._deadline_for(KVPoll.Bootstrapping)
        # when (time.monotonic) the room entered each state it went through: a decode side's
        # Success minus its Transferring is the transfer's own time (the TTFT split of a PD request)
        self.entered: dict[KVPoll, float] = {KVPoll.Bootstrapping: time.monotonic()}

    def _deadline_for(self, state: KVPoll) -> float:
        limit = self._timeouts.get(state)
        return float("inf") if limit is None else time.monotonic() + limit

    @property
    def terminal(self) -> bool:
        return self.state in (KVPoll.Success, KVPoll.Failed)

    def advance(self, to: KVPoll) -> bool:
        """Move forward to `to` (skipping states is allowed, going back is not); the caller holds
        `lock`. False: the room is terminal or already past `to`, nothing changed."""
        if self.terminal or to == KVPoll.Failed or _ORDER.index(to) <= _ORDER.index(self.state):
            return False
        self.state = to
        self.deadline = self._deadline_for(to)
        self.entered[to] = time.monotonic()
        return True

    def fail(self, reason: str) -> bool:
        """Failed with `reason` unless already terminal (the first reason wins); the caller holds
        `lock`. True: this call failed the room."""
        if self.terminal:
            return False
        self.reason = reason
        self.state = KVPoll.Failed
        self.deadline = float("inf")
        return True

    def expired(self, now: float) -> str | None:
        """The timeout reason when the current state has outlived its limit, else None."""
        if self.terminal or now <= self.deadline:
            return None
        return f"{self.state.name} timed out after {self._timeouts[self.state]:g} s"


def timeouts_of(config: DisaggConfig) -> dict[KVPoll, float]:
    """The limit of each non-terminal state, from the config."""
    return {KVPoll.Bootstrapping: config.bootstrap_timeout_s, KVPoll.WaitingForInput: config.waiting_timeout_s,
            KVPoll.Transferring: config.transfer_timeout_s}
