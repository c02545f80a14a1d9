"""The decode side of a PD pair, whatever moves the bytes: one DEALER per prefill bootstrap
server this process has rooms with, and the receivers' states, on one background thread.
tcp_decode.py, nixl_decode.py and mooncake_decode.py add the data.

A receiver says Hello (its room, KV layout and backend) and Posts its pre-allocated pages; the
prefill side answers Welcome (or Abort with a reason: another layout or backend, a refused room).
A prefill side that was heard once and then falls silent for longer than the heartbeat allows
(killed, hung, cut off) fails every room of its connection; one never heard fails at the
bootstrap timeout.

While this side's own operation may still write a room's pages (nixl: a READ in flight),
failing the room is deferred until the operation is cancelled or over: Failed means the pages
are quiet. Only then is the prefill side told (Abort, or Released when it asked first).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from ketch.disagg.config import DisaggConfig
from ketch.disagg.io_loop import IOLoop, tcp_endpoint
from ketch.disagg.layout import KVLayout, check_pages, layout_of, num_pages_of
from ketch.disagg.state import KVPoll, TransferState, timeouts_of
from ketch.disagg.transport import Aux, KVReceiver, KVSender, KVTransport
from ketch.disagg.wire import (Abort, Heartbeat, Hello, Post, Ready, Received, Released, Welcome, decode_to_decode,
                               encode)

log = logging.getLogger(__name__)


@dataclass
class Connection:
    """A DEALER to one prefill bootstrap server (loop thread only)."""

    addr: str
    sock: zmq.Socket
    heard: float | None = None  # when the prefill side last said anything; None: never
    rooms: dict[int, DecodeReceiver] = field(default_factory=dict)
    peer: object | None = None  # the data plane's handle on the prefill side (nixl: its agent)


class DecodeReceiver(KVReceiver):
    def __init__(self, room: int, addr: str, transport: DecodeSide) -> None:
        self.room = room
        self.addr = addr
        self.state = TransferState(timeouts_of(transport.config))
        self._transport = transport
        self.dst_pages: list[int] | None = None
        self.dst: torch.Tensor | None = None  # dst_pages on the pool's device
        self.welcomed = False  # loop thread only
        self.written = 0  # tcp: chunks written (loop thread only)
        self.op: object | None = None  # nixl: the READ in flight (set and cleared under state.lock)
        self.parts: deque[Ready] = deque()  # nixl, mooncake: Readys not yet read, in order (loop thread)
        self.expect = 0  # the page_start the next Ready must have
        self.last_ready = False  # the Ready with the Aux came
        self.failing: tuple[str, object] | None = None  # (reason, message for the peer) once quiet
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
        self.dst_pages = list(dst_pages)
        self.dst = torch.tensor(dst_pages, dtype=torch.int64, device=self._transport.device)
        self._transport.submit(self, self._transport._on_post)

    def abort(self, reason: str) -> None:
        """Failed at once, unless this side's own READ may still write the pages: then once it stopped."""
        with self.state.lock:
            if self.state.terminal or self.failing is not None:
                return
            if self.op is not None:
                self.failing = (f"aborted: {reason}", Abort(self.room, f"peer aborted: {reason}"))
            else:
                self.state.fail(f"aborted: {reason}")
        self._transport.submit(self, self._transport._tell_abort, f"peer aborted: {reason}")

    @property
    def aux(self) -> Aux | None:
        return self._aux if self.state.state == KVPoll.Success else None


class DecodeSide(IOLoop, KVTransport):
    backend = ""  # the data plane's name, sent in every Hello

    def __init__(self, config: DisaggConfig, layers: list[dict[str, torch.Tensor]], model: str = "") -> None:
        if config.mode != "decode":
            raise ValueError(f"mode: a decode transport needs mode 'decode', got {config.mode!r}")
        super().__init__(f"disagg-{self.backend}-decode", tick_s=min(0.1, config.heartbeat_interval_s / 2))
        self.config = config
        self.layers = layers
        self.layout: KVLayout = layout_of(layers, model)
        self.pool_pages = num_pages_of(layers)
        self.device = next(iter(layers[0].values())).device
        self.conns: dict[str, Connection] = {}  # loop thread only
        self.by_socket: dict[zmq.Socket, Connection] = {}
        self.next_beat = 0.0

    # ------------------------------------------------------------ what a data plane implements
    def _on_data(self, conn: Connection, r: DecodeReceiver, msg: object, frames: list) -> None:
        """A data-plane message for open room r."""

    def _on_welcome(self, conn: Connection, msg: Welcome) -> str | None:
        """Take what the Welcome says about the prefill side; a reason to refuse the room, or None."""
        return None

    def _cancel(self, r: DecodeReceiver) -> bool:
        """Stop r's operation in flight; True once nothing of it can write r's pages any more."""
        return True

    def _on_silent(self, conn: Connection) -> None:
        """The prefill side of `conn` is presumed dead (its rooms are being failed)."""

    # ------------------------------------------------------------ the engine's side
    @property
    def bootstrap_addr(self) -> None:
        return None

    def receiver(self, room: int, bootstrap_addr: str) -> DecodeReceiver:
        host, sep, port = bootstrap_addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"bootstrap_addr: 'host:port', got {bootstrap_addr!r}")
        return DecodeReceiver(room, bootstrap_addr, self)

    def sender(self, room: int) -> KVSender:
        raise RuntimeError("a decode transport only receives: senders live on a prefill transport")

    def submit(self, r: DecodeReceiver, fn: Callable[..., None], *args: object) -> None:
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
            try:
                host, _, port = addr.rpartition(":")  # host:port, the host an IPv6 address perhaps
                sock.connect(tcp_endpoint(host, port))
            except zmq.ZMQError:
                sock.close()
                raise
            conn = self.conns[addr] = Connection(addr, sock)
            self.by_socket[sock] = conn
            self.poller.register(sock, zmq.POLLIN)
        return conn

    def _on_init(self, r: DecodeReceiver) -> None:
        try:
            conn = self._connection(r.addr)
        except zmq.ZMQError as e:  # an address the socket refuses: this request fails, the transport serves on
            self._fail(r, f"cannot connect to the prefill side at {r.addr}: {e}", tell=False)
            return
        if r.room in conn.rooms:
            self._fail(r, f"room {r.room} is open already on this decode side", tell=False)
            return
        conn.rooms[r.room] = r
        self._send(conn, Hello(r.room, self.layout, self.backend))

    def _on_post(self, r: DecodeReceiver) -> None:
        conn = self.conns.get(r.addr)
        if conn is None or conn.rooms.get(r.room) is not r:
            return  # failed already
        self._send(conn, Post(r.room, r.dst_pages))
        if r.welcomed:
            with r.state.lock:
                r.state.advance(KVPoll.WaitingForInput)

    def _tell_abort(self, r: DecodeReceiver, reason: str) -> None:
        conn = self.conns.get(r.addr)
        if conn is None or conn.rooms.get(r.room) is not r or r.failing is not None:
            return  # not known there; or the message goes once r's operation stopped (pump)
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
        if r is None or r.failing is not None:
            return  # a room that ended here (or is ending): its late messages are dropped
        if isinstance(msg, Welcome):
            problem = self._on_welcome(conn, msg)
            if problem is not None:
                self._fail(r, problem, tell=True)
                return
            r.welcomed = True
            with r.state.lock:
                if r.dst is not None:
                    r.state.advance(KVPoll.WaitingForInput)
        elif isinstance(msg, Abort):
            self._fail(r, msg.reason, tell=False)
        else:
            self._on_data(conn, r, msg, frames)

    # ------------------------------------------------------------ peer-read data planes (nixl, mooncake)
    def _queue_ready(self, r: DecodeReceiver, msg: Ready, peer_known: bool) -> bool:
        """Check a Ready for r and queue it (True), or fail r with the reason. Readys come in the
        transfer's order, each where the one before ended; the one with the Aux ends at the last page."""
        posted = len(r.dst_pages) if r.dst_pages is not None else None
        end = msg.page_start + len(msg.src_pages)
        if posted is None or not peer_known:
            problem = (f"Ready for {len(msg.src_pages)} pages that cannot be read (pages posted: "
                       f"{posted is not None}, prefill side known: {peer_known})")
        elif r.last_ready or msg.page_start != r.expect or end > posted or (msg.aux is not None) != (end == posted):
            problem = (f"Ready for rows {msg.page_start}..{end} of {posted} posted pages (last: {msg.aux is not None}) "
                       f"out of order: the next rows start at {r.expect}" + (", after the last Ready" if r.last_ready else ""))
        else:
            r.expect, r.last_ready = end, msg.aux is not None
            r.parts.append(msg)
            return True
        self._fail(r, problem, tell=True)
        return False

    def _read(self, conn: Connection, r: DecodeReceiver, msg: Ready) -> None:
        """Start reading the rows `msg` names into r's pages (a peer-read data plane's own)."""
        raise NotImplementedError

    def _next(self, conn: Connection, r: DecodeReceiver) -> None:
        """Start the read of r's next queued Ready (none of r's is in flight); after the last, Success."""
        while r.parts:
            msg = r.parts.popleft()
            if msg.src_pages:
                self._read(conn, r, msg)
                return
            if msg.aux is not None:  # a last Ready of no rows: the parts before it were every row
                self._succeed(conn, r, msg.aux)

    def _succeed(self, conn: Connection, r: DecodeReceiver, aux: Aux) -> None:
        """Every row is written: Success here, Received to the prefill side (its pages may go)."""
        if self.device.type == "cuda":  # rows written on this thread's stream: there before Success says so
            torch.cuda.current_stream(self.device).synchronize()
        with r.state.lock:
            r._aux = aux
            ok = r.state.advance(KVPoll.Success)
        conn.rooms.pop(r.room, None)
        if ok:
            self._send(conn, Received(r.room))

    # ------------------------------------------------------------ time
    def pump(self) -> None:
        for conn in self.conns.values():
            for r in list(conn.rooms.values()):
                if r.failing is not None and self._cancel(r):
                    self._quiesced(conn, r)

    def on_tick(self, now: float) -> None:
        silence = self.config.peer_silence_s
        for conn in self.conns.values():
            silent = conn.heard is not None and now - conn.heard > silence
            if silent:
                self._on_silent(conn)
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

    def _fail(self, r: DecodeReceiver, reason: str, tell: bool) -> None:
        """Fail `r`; with `tell`, its prefill peer records "peer failed: <reason>" (an Abort's
        reason is what the other side records, verbatim); without, the peer asked for it and
        hears Released once no operation of this side can read its pages any more: at once, or
        after the one in flight stopped. (Without the word, a peer-read prefill side held the
        room's pages until its peer-silence allowance ran out.)"""
        message = Abort(r.room, f"peer failed: {reason}") if tell else Released(r.room)
        with r.state.lock:
            if r.state.terminal or r.failing is not None:
                return
            if r.op is not None:
                r.failing = (reason, message)
                return
            r.state.fail(reason)
        conn = self.conns.get(r.addr)
        if conn is not None and conn.rooms.get(r.room) is r:
            conn.rooms.pop(r.room)
            self._send(conn, message)

    def _quiesced(self, conn: Connection, r: DecodeReceiver) -> None:
        reason, message = r.failing
        with r.state.lock:
            r.state.fail(reason)
        conn.rooms.pop(r.room, None)
        self._send(conn, message)

    def close_sockets(self) -> None:
        for conn in self.conns.values():
            conn.sock.close(0)
