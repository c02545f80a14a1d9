"""The mooncake backend, decode side: on Ready, one Mooncake batch READ of its rows from the
prefill side's registered pool into a staging buffer of the room's own; READ done → the rows are
copied into the posted pages under the room's lock. A room's Readys (parts sent while the prompt
ran, then the last with the Aux) are read one after the other; the last copied → Success, Received.

Direction: the decode side READs (as nixl here), not the prefill side WRITEs (as SGLang's
mooncake backend). The side that starts a transfer is the only one that learns when it is over,
and the pages that must never be written after Failed are the decode side's: so the decode side
owns the operation. A WRITE would land in the decode pool by the prefill's engine, unseen here.

Why a staging buffer instead of READing straight into the pages: a Mooncake READ cannot be
cancelled, and one towards a stopped peer blocked for a minute (mooncake_engine.py). Into its own
buffer, a READ in flight never touches the pool, so an abort, a timeout or a silent peer fails
the room at once, and the pages are written only by the copy, after the READ, under the room's
lock and only if the room is still open. The price is one host copy of the rows, and a decode
pool on any device works (the copy moves them there). What waits for the READ is the word to
the prefill side (Released, or Abort when this side failed): its pages are read until the READ
is over. Each READ runs on a daemon thread of its own (it blocks, the GIL released; one that
never returns must not hold up the others, nor the interpreter's exit) and wakes the loop when
done. The control plane is decode_side.py's.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from ketch.disagg.config import DisaggConfig
from ketch.disagg.decode_side import Connection, DecodeReceiver, DecodeSide
from ketch.disagg.mooncake_engine import ReadPlan, local_host, new_engine, read_plan, staged_rows
from ketch.disagg.state import KVPoll
from ketch.disagg.wire import Abort, MooncakePeer, Ready, Released, Welcome

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Read:
    """One room's READ: its staging buffer, and what the loop does when it is over."""

    conn: Connection
    ready: Ready
    plan: ReadPlan
    staging: torch.Tensor
    status: int | None = None  # the engine's answer (0: every byte here); set before `over`
    error: str | None = None
    word: object | None = None  # the room failed meanwhile: the message for the prefill side (loop thread)
    over: threading.Event = field(default_factory=threading.Event)


class MooncakeDecodeTransport(DecodeSide):
    backend = "mooncake"

    def __init__(self, config: DisaggConfig, layers: list[dict[str, torch.Tensor]], model: str = "") -> None:
        self.engine, self.session = new_engine(local_host(config.bootstrap_host))
        super().__init__(config, layers, model)
        self.tensors = [t for layer in layers for t in layer.values()]
        self.reading: dict[DecodeReceiver, _Read] = {}  # READs not yet handled as over (loop thread)
        self.start()

    def _on_welcome(self, conn: Connection, msg: Welcome) -> str | None:
        if msg.mooncake is None:
            return "the prefill side's Welcome carries no Mooncake session"
        conn.peer = msg.mooncake  # a restarted prefill side is another session: the latest Welcome wins
        return None

    def _on_data(self, conn: Connection, r: DecodeReceiver, msg: object, frames: list) -> None:
        if not isinstance(msg, Ready):
            return
        peer = conn.peer
        known = isinstance(peer, MooncakePeer) and len(peer.bases) == len(self.tensors)
        if self._queue_ready(r, msg, known) and r not in self.reading:
            self._next(conn, r)

    def _read(self, conn: Connection, r: DecodeReceiver, msg: Ready) -> None:
        with r.state.lock:
            if r.state.terminal:
                return
            r.state.advance(KVPoll.Transferring)
        plan = read_plan(self.layout, conn.peer.bases, msg.src_pages)
        pin = self.device.type == "cuda"  # the copy into the pool then runs as a DMA
        job = _Read(conn, msg, plan, torch.empty(plan.total, dtype=torch.uint8, pin_memory=pin))
        self.reading[r] = job
        threading.Thread(target=self._run_read, args=(r, job, conn.peer.session), daemon=True,
                         name=f"disagg-mooncake-read-{r.room}").start()

    def _run_read(self, r: DecodeReceiver, job: _Read, session: str) -> None:
        """On the READ's own thread: the blocking READ, then the loop is woken to handle it."""
        base = job.staging.data_ptr()
        try:
            job.status = self.engine.batch_transfer_sync_read(session, [base + o for o in job.plan.local],
                                                              job.plan.remote, job.plan.lengths)
        except Exception as e:  # noqa: BLE001 - the engine's own types; the room fails with the reason
            job.error = repr(e)
        job.over.set()
        self.call(self._landed, r, job)  # False once the loop has ended: the room failed with it

    def _landed(self, r: DecodeReceiver, job: _Read) -> None:
        """The READ is over (loop thread): copy and succeed, or tell the prefill side its pages are free."""
        if self.reading.get(r) is job:
            del self.reading[r]
        if job.word is not None:  # the room failed while the READ ran: only now may the peer free its pages
            self._send(job.conn, job.word)
            return
        if job.status != 0:
            self._fail(r, f"mooncake: the READ failed ({job.error or f'status {job.status}'})", tell=True)
            return
        part = job.ready
        dst = r.dst[part.page_start:part.page_start + len(part.src_pages)]
        with r.state.lock:  # no write after a failure: the engine may have handed the pages on
            if r.state.terminal:
                return
            for j, pool in enumerate(self.tensors):
                pool.index_copy_(0, dst, staged_rows(job.plan, job.staging, j, pool, len(dst)).to(pool.device))
        if part.aux is not None:
            self._succeed(job.conn, r, part.aux)
        else:
            self._next(job.conn, r)

    def _fail(self, r: DecodeReceiver, reason: str, tell: bool) -> None:
        """As decode_side's, except while r's READ runs: Failed at once (the READ writes only
        its staging buffer), the word to the prefill side once the READ is over."""
        job = self.reading.get(r)
        if job is None:
            super()._fail(r, reason, tell)
            return
        with r.state.lock:
            if not r.state.fail(reason):
                return
        job.word = Abort(r.room, f"peer failed: {reason}") if tell else Released(r.room)
        if job.conn.rooms.get(r.room) is r:
            job.conn.rooms.pop(r.room)

    def _tell_abort(self, r: DecodeReceiver, reason: str) -> None:
        job = self.reading.get(r)
        if job is None:
            super()._tell_abort(r, reason)
            return
        job.word = Abort(r.room, reason)  # the engine's abort failed the room already
        if job.conn.rooms.get(r.room) is r:
            job.conn.rooms.pop(r.room)
