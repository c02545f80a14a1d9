"""The tcp backend, decode side: chunks written into the posted pages as they come.

Each chunk is checked (layout digest, span, sizes, crc32) before a byte is written, written with
index_copy_ under the room's lock (never after the room failed: the engine may have handed the
pages on), and credited; Done with the right chunk count and the Aux ends the room: Received
goes back, the room is Success. A wrong chunk fails the room and tells the prefill side why.
The control plane is decode_side.py's.
"""
from __future__ import annotations

import torch

from ketch.disagg.chunks import ChunkRefused, check_chunk, write_span
from ketch.disagg.config import DisaggConfig
from ketch.disagg.decode_side import Connection, DecodeReceiver, DecodeSide
from ketch.disagg.state import KVPoll
from ketch.disagg.wire import Chunk, Credit, Done


class TcpDecodeTransport(DecodeSide):
    backend = "tcp"

    def __init__(self, config: DisaggConfig, layers: list[dict[str, torch.Tensor]], model: str = "") -> None:
        super().__init__(config, layers, model)
        self.start()

    def _on_data(self, conn: Connection, r: DecodeReceiver, msg: object, frames: list) -> None:
        if isinstance(msg, Chunk):
            self._chunk(conn, r, msg, frames)
        elif isinstance(msg, Done):
            self._done(conn, r, msg)

    def _chunk(self, conn: Connection, r: DecodeReceiver, msg: Chunk, frames: list) -> None:
        if r.dst is None or msg.seq != r.written:
            self._fail(r, f"chunk {msg.seq} out of order (expected {r.written}, pages posted: {r.dst is not None})",
                       tell=True)
            return
        try:
            span = check_chunk(msg, frames, self.layout, len(r.dst))
        except ChunkRefused as e:
            self._fail(r, str(e), tell=True)
            return
        with r.state.lock:  # no write after a failure: the engine may have handed the pages on
            if r.state.terminal:
                return
            r.state.advance(KVPoll.Transferring)
            write_span(self.layers, span, r.dst, frames)
        r.written += 1
        self._send(conn, Credit(r.room, msg.seq))

    def _done(self, conn: Connection, r: DecodeReceiver, msg: Done) -> None:
        if r.written != msg.num_chunks or msg.num_chunks < 1:
            self._fail(r, f"done after {r.written} of {msg.num_chunks} chunks", tell=True)
            return
        self._succeed(conn, r, msg.aux)
