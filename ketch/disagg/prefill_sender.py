"""One room's sender on the prefill side (the engine's handle) and the rows it has to send.

The engine hands the rows over in parts: `send_part` after each prompt chunk (the full pages so
far), then `send` with every page and the Aux. The loop thread keeps them as

    pending: parts whose device work may still run (a CUDA event not yet done), in order
    rows:    the source pages ready to be read, in the transfer's order (a prefix of it)
    src:     rows as an int64 tensor on the pool's device (the tcp data plane indexes with it)

and a data plane moves `rows` as they grow: the transfer starts at the first ready part instead
of after the prompt's last chunk, so the bytes move while the prompt still runs. `complete`:
every row is ready and the Aux is there; only then may the transfer end.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ketch.disagg.layout import check_pages
from ketch.disagg.state import TransferState, timeouts_of
from ketch.disagg.transport import Aux, KVSender

if TYPE_CHECKING:
    from ketch.disagg.prefill_side import PrefillSide


@dataclass
class Registration:
    """A decode side's claim on a room: who it is, its pages."""

    peer: bytes  # its ROUTER identity
    since: float
    dst_pages: list[int] | None = None


class PrefillSender(KVSender):
    def __init__(self, room: int, transport: PrefillSide) -> None:
        self.room = room
        self.state = TransferState(timeouts_of(transport.config))
        self._transport = transport
        self.num_pages = 0
        self.given = 0  # rows handed over by send_part (engine thread)
        self.sent = False  # send was called (engine thread)
        # loop thread from here on
        self.pending: deque[tuple[list[int], Callable[[], bool] | None]] = deque()
        self.rows: list[int] = []
        self.src: torch.Tensor | None = None
        self.aux: Aux | None = None
        self.out: object | None = None  # the data plane's progress, once the transfer starts
        self.announced = 0  # nixl, mooncake: rows named in Ready messages so far
        self.final_announced = False  # ... and the last Ready (with the Aux) is out
        self.peer_reads = False  # the decode side may be reading the pages by itself now (under state.lock)
        self.aborting: str | None = None  # the Failed reason waiting for the peer to stop reading (under state.lock)
        self.abort_deadline = float("inf")

    def init(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages: an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        self._transport.submit(self, self._transport._on_init)

    def send_part(self, src_pages: list[int], done: Callable[[], bool] | None = None) -> None:
        if self.sent:
            raise RuntimeError(f"room {self.room}: send_part after send")
        check_pages(src_pages, self._transport.pool_pages, "src_pages")
        if self.given + len(src_pages) > self.num_pages:
            raise ValueError(f"src_pages: parts of {self.given + len(src_pages)} pages in all, init said {self.num_pages}")
        if not src_pages:
            return
        self.given += len(src_pages)
        self._transport.submit(self, self._transport._on_part, list(src_pages), done)

    def send(self, src_pages: list[int], aux: Aux) -> None:
        if self.sent:
            raise RuntimeError(f"room {self.room}: send called twice")
        check_pages(src_pages, self._transport.pool_pages, "src_pages")
        if len(src_pages) != self.num_pages:
            raise ValueError(f"src_pages: {len(src_pages)} pages, init said {self.num_pages}")
        self.sent = True
        self._transport.submit(self, self._transport._on_send, list(src_pages[self.given:]), aux)

    def abort(self, reason: str) -> None:
        """Failed at once, unless the decode side may be reading the pages: then once it stopped."""
        with self.state.lock:
            if self.state.terminal or self.aborting is not None:
                return
            if self.peer_reads:
                self.aborting = f"aborted: {reason}"
            else:
                self.state.fail(f"aborted: {reason}")
        self._transport.submit(self, self._transport._tell_abort, f"peer aborted: {reason}")

    # ------------------------------------------------------------ loop thread
    @property
    def complete(self) -> bool:
        """Every row is ready to be read and the Aux is there."""
        return self.aux is not None and not self.pending

    @property
    def waiting_on_device(self) -> bool:
        return bool(self.pending) and self.pending[0][1] is not None

    def take_ready(self) -> bool:
        """Move the parts whose device work is over into `rows`; True if rows grew or the
        sender just became complete."""
        grew = False
        while self.pending and (self.pending[0][1] is None or self.pending[0][1]()):
            pages, _ = self.pending.popleft()
            if pages:
                self.rows.extend(pages)
                grew = True
        if grew:
            self.src = torch.tensor(self.rows, dtype=torch.int64, device=self._transport.device)
        return grew or self.complete
