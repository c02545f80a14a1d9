"""The KV arrival gate (scheduler/gate.py): on a decode server of a PD pair, a request waits here
while its prompt's KV and first token come from the prefill server (ketch/disagg/README.md).

    park ─▶ queued until the pool has pages for the prompt (arrival order; failed after the
         timeout) ─▶ receiver(room, host:port).init() ─▶ post_buffers(pages)
         poll() each step ──Success──▶ the pages become the request's (its prompt computed), its
                                       first output is aux.first_token ─▶ the scheduler runs it
                          └─Failed───▶ pages freed, the request ends with the transfer's error
         abort while parked ─▶ receiver.abort; the pages are freed once poll() is terminal

The pages sit in a `PageHold` while the request is PENDING (a pending request holds none), and
are freed only after Failed: the transport writes into them until then (PRIOR_ART known
failures 3 and 4; its own timeouts guarantee Failed comes). Nothing here waits on the transport.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from ketch.cache.manager import KVCacheManager
from ketch.disagg import KVPoll, KVReceiver, KVTransport
from ketch.engine.pd_prefill import PageHold
from ketch.scheduler.request import Request

POLL_WAIT_S = 0.002  # an otherwise idle engine sleeps this long between polls of parked transfers


@dataclass(eq=False)
class _Parked:
    samples: list[Request]
    receiver: KVReceiver | None
    hold: PageHold
    error: str | None = None  # refused before a transfer began (no room for the pages)
    parked_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Arrival:
    """A request whose KV is here: its first token, and the TTFT split so far (seconds): the
    prefill server's own time (from the Aux), the transfer's (Transferring -> Success here), the
    wait at this gate (park -> Success), and when Success came (time.monotonic)."""

    req: Request
    token: int
    prefill_s: float
    transfer_s: float
    kv_wait_s: float
    arrived_at: float


@dataclass(eq=False)
class _Queued:
    """A request the pool had no pages for yet: it waits, in arrival order, before its transfer
    begins (its prefill server holds the KV meanwhile: its sender waits for this registration)."""

    samples: list[Request]
    need: tuple[str, int]
    since: float = field(default_factory=time.monotonic)


class KVArrivalGate:
    def __init__(self, transport: KVTransport, kv: KVCacheManager, room_timeout_s: float = 300.0) -> None:
        """room_timeout_s: how long a request may wait for pages before it fails (the server's
        --disaggregation-timeout, like every other wait of a transfer)."""
        self.transport, self.kv, self.room_timeout_s = transport, kv, room_timeout_s
        self.queued: list[_Queued] = []
        self.parked: list[_Parked] = []
        self.orphans: list[_Parked] = []  # aborted while parked: their pages wait for a terminal poll
        self.arrived: list[Arrival] = []  # since the engine last looked
        self.succeeded = self.failed = 0  # ended transfers (for /metrics; refusals before one began count as failed)

    def park(self, samples: list[Request], need: tuple[str, int]) -> None:
        """need: (the prefill server's bootstrap "host:port", the room)."""
        self.queued.append(_Queued(list(samples), need))
        self._admit()

    def _admit(self) -> None:
        """Pages for the queued requests in arrival order (the first that does not fit holds back
        those after it, so a long prompt is not starved by short ones); each that gets them
        registers its room and posts them. One that waited past the timeout fails."""
        while self.queued:
            q = self.queued[0]
            pages = self.kv.pages_for(len(q.samples[0].prompt_ids))  # a PD request has one sample
            if not self.kv.make_room(pages):
                break
            self.queued.pop(0)
            hold = PageHold(self.kv.allocator.alloc(pages))
            addr, room = q.need
            receiver = self.transport.receiver(room, addr)
            receiver.init()
            receiver.post_buffers(hold.page_table)
            self.parked.append(_Parked(q.samples, receiver, hold))
        now, waiting = time.monotonic(), []
        for q in self.queued:
            if now - q.since <= self.room_timeout_s:
                waiting.append(q)
                continue
            pages = self.kv.pages_for(len(q.samples[0].prompt_ids))
            error = (f"bootstrap_room: KV transfer failed: no room for the prompt's {pages} KV pages on this decode "
                     f"server within {self.room_timeout_s:g} s")
            self.parked.append(_Parked(q.samples, None, PageHold(), error))
        self.queued = waiting

    def release(self) -> list[tuple[list[Request], Exception | None]]:
        self.orphans = [p for p in self.orphans if not self._ended(p)]
        self._admit()
        out: list[tuple[list[Request], Exception | None]] = []
        waiting: list[_Parked] = []
        for p in self.parked:
            if p.receiver is None:
                self.failed += 1
                out.append((p.samples, ValueError(p.error)))
                continue
            state = p.receiver.poll()
            if state == KVPoll.Success:
                self.succeeded += 1
                out.append((p.samples, None))
                self._deliver(p)
            elif state == KVPoll.Failed:
                self.failed += 1
                self.kv.allocator.decref(p.hold.page_table)
                out.append((p.samples, ValueError(f"bootstrap_room: KV transfer failed: {p.receiver.failure}")))
            else:
                waiting.append(p)
        self.parked = waiting
        return out

    def _deliver(self, p: _Parked) -> None:
        """The prompt's KV is in the held pages: they become the request's, its first token its output."""
        req, aux = p.samples[0], p.receiver.aux
        assert aux is not None, "a receiver at Success has the sender's Aux"
        req.page_table, p.hold.page_table = p.hold.page_table, []
        req.num_computed = len(req.prompt_ids)
        req.output_ids.append(aux.first_token)
        entered = p.receiver.state.entered
        done = entered.get(KVPoll.Success, time.monotonic())
        prefill_s, kv_wait_s = _prefill_seconds(aux.extra), done - p.parked_at
        # the transfer's share of TTFT: what it added after the prompt ran. Parts of a pipelined
        # transfer move while the prefill runs (Transferring starts with the first), so its whole
        # span would count the prefill twice; both requests reach their servers at once (the gateway)
        transfer_s = (max(0.0, kv_wait_s - prefill_s) if prefill_s >= 0
                      else done - entered.get(KVPoll.Transferring, done))
        self.arrived.append(Arrival(req, aux.first_token, prefill_s, transfer_s, kv_wait_s, done))

    def _ended(self, p: _Parked) -> bool:
        if p.receiver is not None and p.receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
            return False
        self.kv.allocator.decref(p.hold.page_table)
        p.hold.page_table = []
        return True

    def take_arrived(self) -> list[Arrival]:
        arrived, self.arrived = self.arrived, []
        return arrived

    def live_states(self) -> list[KVPoll]:
        """Parked requests' transfers (a refused one, with no transfer, is not live)."""
        return [p.receiver.poll() for p in self.parked if p.receiver is not None]

    def has_parked(self) -> bool:
        return bool(self.queued or self.parked or self.orphans)

    def wait(self, timeout: float) -> None:
        """The transport has no event to wait on: sleep a little, then the loop polls again."""
        time.sleep(min(timeout, POLL_WAIT_S))

    def forget(self, req: Request) -> None:
        self.queued = [q for q in self.queued if req not in q.samples]  # no transfer, no pages yet
        for p in self.parked:
            if req in p.samples:
                if p.receiver is not None:
                    p.receiver.abort("the request was aborted on the decode server")
                self.orphans.append(p)
        self.parked = [p for p in self.parked if req not in p.samples]

    def holds(self) -> list[PageHold]:
        return [p.hold for p in self.parked + self.orphans if p.hold.page_table]


def _prefill_seconds(extra: bytes) -> float:
    """The prefill server's time for the request, from its Aux (-1: a sender that did not say)."""
    try:
        value = msgspec.json.decode(extra).get("prefill_s") if extra else None
    except (msgspec.DecodeError, AttributeError):
        value = None
    return float(value) if isinstance(value, (int, float)) else -1.0
