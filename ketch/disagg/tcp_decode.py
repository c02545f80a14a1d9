"""The tcp backend, decode side: the receivers, on one background thread.

One DEALER per prefill bootstrap server this process has rooms with. A receiver says Hello (its
room and KV layout) and Posts its pre-allocated pages; the prefill side answers Welcome (or Abort
with a reason: another layout, a refused room), then streams the chunks. Each chunk is checked
(layout digest, span, sizes, crc32) before a byte is written, written with index_copy_ under the
room's lock, and credited; Done with the right chunk count and the Aux ends the room: Received
goes back, the room is Success. A wrong chunk fails the room and tells the prefill side why.

A prefill side that was heard once and then falls silent for longer than the heartbeat allows
(killed, hung, cut off) fails every room of its connection; one never heard fails at the
bootstrap timeout.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from ketch.disagg.chunks import ChunkRefused, check_chunk, write_span
from ketch.disagg.config import DisaggConfig
from ketch.disagg.fake import timeouts_of
from ketch.disagg.io_loop import IOLoop
from ketch.disagg.layout import KVLayout, check_pages, layout_of, num_pages_of
from ketch.disagg.state import KVPoll, TransferState
from ketch.disagg.transport import Aux, KVReceiver, KVSender, KVTransport
from ketch.disagg.wire import Abort, Chunk, Credit, Done, Heartbeat, Hello, Post, Received, Welcome, decode_to_decode, encode

log = logging.getLogger(__name__)


@dataclass
class Connection:
    """A DEALER to one prefill bootstrap server (loop thread only)."""

    addr: str
    sock: zmq.Socket
    heard: float | None = None  # when the prefill side last said anything; None: never
    rooms: dict[int, TcpReceiver] = field(default_factory=dict)


class TcpReceiver(KVReceiver):
    def __init__(self, room: int, addr: str, transport: TcpDecodeTransport) -> None:
        self.room = room
        self.addr = addr
        self.state = TransferState(timeouts_of(transport.config))
        self._transport = transport
        self.dst: torch.Tensor | None = None
        self.welcomed = False  # loop thread only
        self.written = 0  # chunks written (loop thread only)
        self._aux: Aux | None = None
        self._initialised = False

    def init(self) -> None:
        self._initialised = True
        self._transport.submit(self, self._transport._on_init)

    def post_buffers(self, dst_pages: list[int]) -> None:
        if not self._initialised:
            raise RuntimeError(f"room {self.room}: post_buffers before init")
        if self.dst is not None:
            raise RuntimeError(f"room {self.room}: post_buffers called twice")
        check_pages(dst_pages, self._transport.pool_pages, "dst_pages")
        self.dst = torch.tensor(dst_pages, dtype=torch.int64, device=self._transport.device)
        self._transport.submit(self, self._transport._on_post, list(dst_pages))

    def poll(self) -> KVPoll:
        return self.state.state

    def abort(self, reason: str) -> None:
        with self.state.lock:
            failed = self.state.fail(f"aborted: {reason}")
        if failed:
            self._transport.submit(self, self._transport._tell_abort, f"peer aborted: {reason}")

    @property
    def failure(self) -> str | None:
        return self.state.reason

    @property
    def aux(self) -> Aux | None:
        return self._aux if self.state.state == KVPoll.Success else None


class TcpDecodeTransport(IOLoop, KVTransport):
    def __init__(self, config: DisaggConfig, layers: list[dict[str, torch.Tensor]], model: str = "") -> None:
        if config.mode != "decode":
            raise ValueError(f"mode: a decode transport needs mode 'decode', got {config.mode!r}")
        super().__init__("disagg-decode", tick_s=min(0.1, config.heartbeat_interval_s / 2))
        self.config = config
        self.layers = layers
        self.layout: KVLayout = layout_of(layers, model)
        self.pool_pages = num_pages_of(layers)
        self.device = next(iter(layers[0].values())).device
        self.conns: dict[str, Connection] = {}  # loop thread only
        self.by_socket: dict[zmq.Socket, Connection] = {}
        self.next_beat = 0.0
        self.start()

    # ------------------------------------------------------------ the engine's side
    @property
    def bootstrap_addr(self) -> None:
        return None

    def receiver(self, room: int, bootstrap_addr: str) -> TcpReceiver:
        host, sep, port = bootstrap_addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"bootstrap_addr: 'host:port', got {bootstrap_addr!r}")
        return TcpReceiver(room, bootstrap_addr, self)

    def sender(self, room: int) -> KVSender:
        raise RuntimeError("a decode transport only receives: senders live on a prefill transport")

    def submit(self, r: TcpReceiver, fn, *args: object) -> None:
        self.track(r.state)
        if not self.call(fn, r, *args):
            with r.state.lock:
                r.state.fail("transport closed")

    def close(self) -> None:
        self.stop()

    # ------------------------------------------------------------ commands (loop thread)
    def _connection(self, addr: str) -> Connection:
        conn = self.conns.get(addr)
        if conn is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{addr}")
            conn = self.conns[addr] = Connection(addr, sock)
            self.by_socket[sock] = conn
            self.poller.register(sock, zmq.POLLIN)
        return conn

    def _on_init(self, r: TcpReceiver) -> None:
        conn = self._connection(r.addr)
        if r.room in conn.rooms:
            self._fail(r, f"room {r.room} is open already on this decode side", tell=False)
            return
        conn.rooms[r.room] = r
        self._send(conn, Hello(r.room, self.layout))

    def _on_post(self, r: TcpReceiver, dst_pages: list[int]) -> None:
        conn = self.conns.get(r.addr)
        if conn is None or conn.rooms.get(r.room) is not r:
            return  # failed (or never initialised: post_buffers before init is a caller's bug, left to time out)
        self._send(conn, Post(r.room, dst_pages))
        if r.welcomed:
            with r.state.lock:
                r.state.advance(KVPoll.WaitingForInput)

    def _tell_abort(self, r: TcpReceiver, reason: str) -> None:
        conn = self.conns.get(r.addr)
        if conn is not None and conn.rooms.get(r.room) is r:
            conn.rooms.pop(r.room)
            self._send(conn, Abort(r.room, reason))

    # ------------------------------------------------------------ incoming
    def on_ready(self, ready: dict) -> None:
        for sock in ready:
            conn = self.by_socket[sock]
            while True:
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                conn.heard = time.monotonic()
                try:
                    msg = decode_to_decode(parts[0].bytes)
                except msgspec.DecodeError as e:  # drop it; the room it was meant for times out if it matters
                    log.warning("disagg decode side: dropped a malformed message from %s (%s)", conn.addr, e)
                    continue
                self._handle(conn, msg, [p.buffer for p in parts[1:]])

    def _handle(self, conn: Connection, msg: object, frames: list) -> None:
        if isinstance(msg, Heartbeat):
            return
        r = conn.rooms.get(msg.room)
        if r is None:
            return  # a room that ended here already (aborted, timed out): its late messages are dropped
        if isinstance(msg, Welcome):
            r.welcomed = True
            with r.state.lock:
                if r.dst is not None:
                    r.state.advance(KVPoll.WaitingForInput)
        elif isinstance(msg, Chunk):
            self._chunk(conn, r, msg, frames)
        elif isinstance(msg, Done):
            if r.written != msg.num_chunks:
                self._fail(r, f"done after {r.written} of {msg.num_chunks} chunks", tell=True)
                return
            if self.device.type == "cuda":  # the rows were written on this thread's stream: done before Success
                torch.cuda.current_stream(self.device).synchronize()
            with r.state.lock:
                r._aux = msg.aux
                ok = r.state.advance(KVPoll.Success)
            conn.rooms.pop(r.room)
            if ok:
                self._send(conn, Received(r.room))
        elif isinstance(msg, Abort):
            self._fail(r, msg.reason, tell=False)

    def _chunk(self, conn: Connection, r: TcpReceiver, msg: Chunk, frames: list) -> None:
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

    # ------------------------------------------------------------ time
    def on_tick(self, now: float) -> None:
        silence = self.config.peer_silence_s
        for conn in self.conns.values():
            silent = conn.heard is not None and now - conn.heard > silence
            for r in list(conn.rooms.values()):
                reason = r.state.expired(now)
                if reason is None and silent:
                    reason = f"prefill peer at {conn.addr} silent for over {silence:g} s (heartbeat)"
                if reason is not None:
                    self._fail(r, reason, tell=True)
                elif r.state.terminal:
                    conn.rooms.pop(r.room)
            if not conn.rooms:
                conn.heard = None  # a quiet connection without rooms is no sign of death
        if now >= self.next_beat:
            self.next_beat = now + self.config.heartbeat_interval_s
            for conn in self.conns.values():
                if conn.rooms:
                    self._send(conn, Heartbeat())
        self.prune()

    def _send(self, conn: Connection, msg: object) -> None:
        try:
            conn.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # the prefill side is not connected (yet) and the queue is full: the timeouts decide
            pass

    def _fail(self, r: TcpReceiver, reason: str, tell: bool) -> None:
        """Fail `r` here; with `tell`, its prefill peer records "peer failed: <reason>" (an
        Abort's reason is what the other side records, verbatim)."""
        with r.state.lock:
            failed = r.state.fail(reason)
        conn = self.conns.get(r.addr)
        if conn is not None and conn.rooms.get(r.room) is r:
            conn.rooms.pop(r.room)
            if failed and tell:
                self._send(conn, Abort(r.room, f"peer failed: {reason}"))

    def close_sockets(self) -> None:
        for conn in self.conns.values():
            conn.sock.close(0)
