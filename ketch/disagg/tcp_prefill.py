"""The tcp backend, prefill side: page rows pushed over the bootstrap connection in chunks.

A started transfer is cut into chunks (chunks.py), sent window_chunks ahead of the receiver's
Credits, each with a header (room, layer range, page range, crc32, layout digest); Done with the
Aux follows the last one. Rows that become ready while the prompt runs (send_part) are planned
and sent as they come: the chunk plan grows, the receiver only sees more chunks in order. Rows are read under the room's lock and only while it is open, so once
a room failed its pages are not read again. The control plane is prefill_side.py's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ketch.disagg.chunks import Span, checksum, plan_chunks, read_span
from ketch.disagg.config import DisaggConfig
from ketch.disagg.prefill_sender import PrefillSender, Registration
from ketch.disagg.prefill_side import PrefillSide
from ketch.disagg.wire import Chunk, Credit, Done

# (seq, frames) -> frames: what goes on the wire. Tests put a fault here (a flipped byte); None in serving.
WireHook = Callable[[int, list], list]


@dataclass
class Outgoing:
    """A started transfer's progress (loop thread only)."""

    peer: bytes
    plan: list[Span]
    planned: int = 0  # rows the plan covers
    next_seq: int = 0
    credited: int = 0
    done_sent: bool = False


class TcpPrefillTransport(PrefillSide):
    backend = "tcp"

    def __init__(self, config: DisaggConfig, layers: list[dict[str, torch.Tensor]], model: str = "",
                 wire_hook: WireHook | None = None) -> None:
        super().__init__(config, layers, model)
        self.wire_hook = wire_hook
        self.start()

    def _start(self, s: PrefillSender, reg: Registration) -> None:
        s.out = Outgoing(reg.peer, [])
        self._grow(s)

    def _grow(self, s: PrefillSender) -> None:
        out = s.out
        if len(s.rows) > out.planned:
            out.plan += plan_chunks(self.layout, out.planned, len(s.rows), self.config.chunk_bytes)
            out.planned = len(s.rows)

    def _may_succeed(self, s: PrefillSender) -> bool:
        return s.out is not None and s.out.done_sent

    def _on_data(self, peer: bytes, s: PrefillSender | None, msg: object) -> None:
        if isinstance(msg, Credit) and s is not None and s.out is not None:
            s.out.credited += 1

    def pump(self) -> None:
        super().pump()
        for s in list(self.senders.values()):
            out = s.out
            if out is None or out.done_sent:
                continue
            while out.next_seq < len(out.plan) and out.next_seq - out.credited < self.config.window_chunks:
                if not self._send_chunk(s, out):
                    break
            if out.next_seq == len(out.plan) and s.complete and out.planned == s.num_pages:
                out.done_sent = self._send(out.peer, Done(s.room, len(out.plan), s.aux), s)

    def _send_chunk(self, s: PrefillSender, out: Outgoing) -> bool:
        span = out.plan[out.next_seq]
        with s.state.lock:  # no read of src pages once the room failed: the engine may have freed them
            if s.state.terminal:
                return False
            frames = read_span(self.layers, span, s.src)
        header = Chunk(s.room, out.next_seq, span.layer_start, span.layer_end, span.page_start, span.page_count,
                       checksum(frames), self.layout.digest)
        if self.wire_hook is not None:
            frames = self.wire_hook(out.next_seq, frames)
        if not self._send(out.peer, header, s, frames):
            return False
        out.next_seq += 1
        return True
