"""The prefill side of a PD pair (issue 17): each request with a bootstrap room sends its prompt's
KV and first token to the decode server that holds the same room (ketch/disagg/README.md).

    add_request ──▶ sender(room).init(prompt pages)          (the decode side may register meanwhile)
    prompt runs as usual (max_len = prompt + 1: it stops after its first token)
    each prompt chunk launched ──▶ hold its newly full pages ──▶ send_part(pages, written?)
       (pipelining: they move while the rest of the prompt runs; on CUDA once the chunk's event is done)
    first token processed ──▶ hold the rest of the prompt's pages ──▶ send(pages, Aux(token))
       the request finishes as usual (its pages go to the radix cache; the hold keeps them alive)
    poll() each step ──Success──▶ drop the hold; report the token, finished   (the client's answer)
                     └─Failed───▶ drop the hold; report the failure as an error

The hold is a page holder of its own (the KV manager's invariants count it), so neither eviction
nor a later request can reuse a page the transport may still read (PRIOR_ART known failure 5):
the pages come back only once poll() is terminal. Nothing here waits on the transport.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from ketch.cache.manager import KVCacheManager
from ketch.disagg import Aux, KVPoll, KVSender, KVTransport
from ketch.engine.outputs import TokenLogprob
from ketch.scheduler.request import Request


@dataclass(eq=False)
class PageHold:
    """Pages a transfer may still touch: a page holder with no radix lock and nothing computed."""

    page_table: list[int] = field(default_factory=list)
    cache_node: None = None
    num_computed: int = 0
    num_inserted_pages: int = 0
    num_resolved: int = 0

    def tokens(self, lo: int, hi: int) -> list[int]:
        return []


@dataclass(eq=False)
class _Send:
    req: Request
    sender: KVSender
    hold: PageHold | None = None  # set once the first page is handed to the transport
    given: int = 0  # prompt pages handed over by send_part
    token: int = -1
    logprobs: list[TokenLogprob] | None = None
    aborted: bool = False  # its client is gone: end the transfer, report nothing
    started: float = field(default_factory=time.monotonic)  # when the request reached this engine


@dataclass(frozen=True)
class SendDone:
    req: Request
    token: int
    logprobs: list[TokenLogprob] | None
    error: str | None  # None: the decode side has every byte (a failure may come before the first token)


class PrefillSends:
    def __init__(self, transport: KVTransport, kv: KVCacheManager) -> None:
        self.transport, self.kv = transport, kv
        self.sends: dict[str, _Send] = {}  # rid -> its transfer, from add_request to a terminal poll
        self.succeeded = self.failed = 0  # ended transfers (for /metrics)
        self.pages_sent_early = 0  # pages given by send_part (for /metrics)

    def start(self, req: Request, room: int) -> None:
        sender = self.transport.sender(room)
        sender.init(self.kv.pages_for(len(req.prompt_ids)))
        req.max_len = len(req.prompt_ids) + 1  # the prefill side makes the first token only
        self.sends[req.rid] = _Send(req, sender)

    def progress(self, reqs: list[Request], device: torch.device) -> None:
        """A step's forward is launched: the prompt pages it filled go to the transport now, while
        the rest of the prompt runs. Only full pages (a later chunk writes on into a partial one)."""
        written: Callable[[], bool] | None = None
        for req in reqs:
            s = self.sends.get(req.rid)
            if s is None or s.aborted or req.num_computed >= len(req.prompt_ids):
                continue  # the prompt's last chunk: `send` follows with the first token
            full = req.num_computed // self.kv.page_size
            if full <= s.given:
                continue
            if written is None and device.type == "cuda":
                event = torch.cuda.Event()
                event.record()  # after this step's forward on the engine's stream
                written = event.query
            pages = req.page_table[s.given:full]
            self._hold(s, pages)
            s.sender.send_part(pages, written)
            s.given = full
            self.pages_sent_early += len(pages)

    def _hold(self, s: _Send, pages: list[int]) -> None:
        self.kv.allocator.incref(pages)
        if s.hold is None:
            s.hold = PageHold()
        s.hold.page_table.extend(pages)

    def send(self, req: Request, token: int, logprobs: list[TokenLogprob] | None) -> None:
        """The step that sampled `req`'s first token is processed: its prompt's KV is in its pages.
        Pages given by `progress` are held already (after a preemption the prompt may sit in
        other pages now: the transport reads those rows from the pages it was given)."""
        s = self.sends[req.rid]
        pages = req.page_table[: self.kv.pages_for(len(req.prompt_ids))]
        self._hold(s, pages[s.given:])
        s.token, s.logprobs = token, logprobs
        # the prefill's own time (queue + prompt) travels with the KV: the decode side reports it
        # in the TTFT split of the request's usage (engine/pd_timing.py)
        s.sender.send(pages, Aux(token, msgspec.json.encode({"prefill_s": time.monotonic() - s.started})))

    def abort(self, req: Request, reason: str) -> bool:
        """The client is gone: fail the room at both ends (its pages come back once poll() says so).
        True when its transfer was still open (then nothing more is reported for it)."""
        s = self.sends.get(req.rid)
        if s is None or s.aborted:
            return False
        s.aborted = True
        s.sender.abort(reason)
        return True

    def poll(self) -> list[SendDone]:
        """Transfers that ended since the last call; their pages are given back here."""
        done: list[SendDone] = []
        for rid, s in list(self.sends.items()):
            state = s.sender.poll()
            if state not in (KVPoll.Success, KVPoll.Failed):
                continue
            del self.sends[rid]
            if s.hold is not None:
                self.kv.allocator.decref(s.hold.page_table)
            error = None if state == KVPoll.Success else f"bootstrap_room: KV transfer failed: {s.sender.failure}"
            self.succeeded += error is None
            self.failed += error is not None
            if not s.aborted:
                done.append(SendDone(s.req, s.token, s.logprobs, error))
        return done

    def holds(self) -> list[PageHold]:
        return [s.hold for s in self.sends.values() if s.hold is not None]

    def live_states(self) -> list[KVPoll]:
        return [s.sender.poll() for s in self.sends.values()]

    def has_work(self) -> bool:
        return bool(self.sends)
