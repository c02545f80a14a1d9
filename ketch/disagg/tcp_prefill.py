"""The tcp backend, prefill side: the bootstrap server and the senders, on one background thread.

The bootstrap server is a ZMQ ROUTER on `bootstrap_port`. A decode side registers a room there
(Hello with its KV layout, then Post with its pre-allocated pages); the prefill engine's sender
for that room looks the registration up when it is created, or is attached when it arrives (the
gateway sends a request to both servers at once: either may come first). The same connection
then carries the data chunks back, window_chunks in flight, each answered by a Credit. The
sender's Success is the receiver's Received: every byte written there.

A registration nobody claims within bootstrap_timeout_s is refused (Abort) and dropped, so a
decode side never waits for a prefill request that will not come. ROUTER_MANDATORY turns a send
to a vanished decode process into an error (its room fails at once) instead of a silent drop.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import zmq

from ketch.disagg.chunks import Span, checksum, plan_chunks, read_span
from ketch.disagg.config import DisaggConfig
from ketch.disagg.fake import timeouts_of
from ketch.disagg.io_loop import IOLoop
from ketch.disagg.layout import KVLayout, check_pages, layout_of, num_pages_of
from ketch.disagg.state import KVPoll, TransferState
from ketch.disagg.transport import Aux, KVReceiver, KVSender, KVTransport
from ketch.disagg.wire import Abort, Chunk, Credit, Done, Heartbeat, Hello, Post, Received, Welcome, decode_to_prefill, encode

log = logging.getLogger(__name__)

# (seq, frames) -> frames: what goes on the wire. Tests put a fault here (a flipped byte); None in serving.
WireHook = Callable[[int, list], list]


@dataclass
class Registration:
    """A decode side's claim on a room: who it is, its pages."""

    peer: bytes  # its ROUTER identity
    since: float
    dst_pages: list[int] | None = None


@dataclass
class Outgoing:
    """A started transfer's progress (loop thread only)."""

    peer: bytes
    plan: list[Span]
    next_seq: int = 0
    credited: int = 0
    done_sent: bool = False


class TcpSender(KVSender):
    def __init__(self, room: int, transport: TcpPrefillTransport) -> None:
        self.room = room
        self.state = TransferState(timeouts_of(transport.config))
        self._transport = transport
        self.num_pages = 0
        self.src: torch.Tensor | None = None
        self.aux: Aux | None = None
        self.out: Outgoing | None = None  # the loop's, once the transfer starts

    def init(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages: an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        self._transport.submit(self, self._transport._on_init)

    def send(self, src_pages: list[int], aux: Aux) -> None:
        if self.src is not None:
            raise RuntimeError(f"room {self.room}: send called twice")
        check_pages(src_pages, self._transport.pool_pages, "src_pages")
        if len(src_pages) != self.num_pages:
            raise ValueError(f"src_pages: {len(src_pages)} pages, init said {self.num_pages}")
        self.aux = aux
        self.src = torch.tensor(src_pages, dtype=torch.int64, device=self._transport.device)
        self._transport.submit(self, self._transport._on_send)

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


class TcpPrefillTransport(IOLoop, KVTransport):
    def __init__(self, config: DisaggConfig, layers: list[dict[str, torch.Tensor]], model: str = "",
                 wire_hook: WireHook | None = None) -> None:
        if config.mode != "prefill":
            raise ValueError(f"mode: a prefill transport needs mode 'prefill', got {config.mode!r}")
        super().__init__("disagg-prefill", tick_s=min(0.1, config.heartbeat_interval_s / 2))
        self.config = config
        self.layers = layers
        self.layout: KVLayout = layout_of(layers, model)
        self.pool_pages = num_pages_of(layers)
        self.device = next(iter(layers[0].values())).device
        self.wire_hook = wire_hook
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        host = config.bootstrap_host
        if config.bootstrap_port == 0:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        else:
            port = config.bootstrap_port
            self.sock.bind(f"tcp://{host}:{port}")
        self._addr = f"{host}:{port}"
        self.poller.register(self.sock, zmq.POLLIN)
        # loop thread only, from here on
        self.senders: dict[int, TcpSender] = {}
        self.regs: dict[int, Registration] = {}
        self.refused: dict[int, tuple[str, float]] = {}  # room -> (reason, until): for a sender that comes later
        self.heard: dict[bytes, float] = {}  # peer -> when it last said anything
        self.next_beat = 0.0
        self.start()

    # ------------------------------------------------------------ the engine's side
    @property
    def bootstrap_addr(self) -> str:
        return self._addr

    def sender(self, room: int) -> TcpSender:
        return TcpSender(room, self)

    def receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        raise RuntimeError("a prefill transport only sends: receivers live on a decode transport")

    def submit(self, sender: TcpSender, fn: Callable[..., None], *args: object) -> None:
        self.track(sender.state)
        if not self.call(fn, sender, *args):
            with sender.state.lock:
                sender.state.fail("transport closed")

    def close(self) -> None:
        self.stop()

    # ------------------------------------------------------------ commands (loop thread)
    def _on_init(self, s: TcpSender) -> None:
        self.senders[s.room] = s
        refused = self.refused.pop(s.room, None)
        if refused is not None:
            self._fail(s, refused[0], tell=None)
        else:
            self._attach(s)

    def _on_send(self, s: TcpSender) -> None:
        self._attach(s)

    def _tell_abort(self, s: TcpSender, reason: str) -> None:
        reg = self.regs.pop(s.room, None)
        self.senders.pop(s.room, None)
        if reg is not None:
            self._send(reg.peer, Abort(s.room, reason))
        else:  # the decode side has not registered yet: refuse it when it does
            self.refused[s.room] = (reason, time.monotonic() + self.config.bootstrap_timeout_s)

    # ------------------------------------------------------------ the bootstrap server
    def on_ready(self, ready: dict) -> None:
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 2:
                log.warning("disagg bootstrap server: dropped a message of %d frames", len(parts))
                continue
            peer, data = parts
            self.heard[peer] = time.monotonic()
            try:
                msg = decode_to_prefill(data)
            except msgspec.DecodeError as e:  # a stray or newer client: drop it, keep the server up
                log.warning("disagg bootstrap server: dropped a malformed message (%s)", e)
                continue
            self._handle(peer, msg)

    def _handle(self, peer: bytes, msg: object) -> None:
        if isinstance(msg, Heartbeat):
            return
        if isinstance(msg, Hello):
            self._hello(peer, msg)
            return
        reg = self.regs.get(msg.room)
        if reg is not None and reg.peer != peer:
            return  # about a room another decode side holds: not this peer's to change
        s = self.senders.get(msg.room)
        if isinstance(msg, Post):
            if reg is not None:
                reg.dst_pages = list(msg.dst_pages)
                if s is not None:
                    self._attach(s)
        elif isinstance(msg, Credit):
            if s is not None and s.out is not None:
                s.out.credited += 1
        elif isinstance(msg, Received):
            self.regs.pop(msg.room, None)
            self.senders.pop(msg.room, None)
            if s is not None and s.out is not None and s.out.done_sent:
                with s.state.lock:
                    s.state.advance(KVPoll.Success)
        elif isinstance(msg, Abort):
            self.regs.pop(msg.room, None)
            if s is not None:
                self._fail(s, msg.reason, tell=None)
            else:
                self.refused[msg.room] = (msg.reason, time.monotonic() + self.config.bootstrap_timeout_s)

    def _hello(self, peer: bytes, msg: Hello) -> None:
        if msg.room in self.regs:  # a second decode request for a room: refuse it, leave the first alone
            self._send(peer, Abort(msg.room, f"room {msg.room} is registered already by another decode request"))
            return
        if msg.room in self.refused:  # aborted or refused here before this decode side registered
            self._send(peer, Abort(msg.room, self.refused[msg.room][0]))
            return
        problem = self.layout.difference(msg.layout, "at the prefill side", "at the decode side")
        if problem is not None:
            self._send(peer, Abort(msg.room, problem))
            s = self.senders.get(msg.room)
            if s is not None:
                self._fail(s, problem, tell=None)
            else:
                self.refused[msg.room] = (problem, time.monotonic() + self.config.bootstrap_timeout_s)
            return
        self.regs[msg.room] = Registration(peer, time.monotonic())
        self._send(peer, Welcome(msg.room))

    def _attach(self, s: TcpSender) -> None:
        """The sender meets its registration: WaitingForInput, or the transfer starts."""
        reg = self.regs.get(s.room)
        if reg is None or reg.dst_pages is None or s.num_pages == 0 or s.out is not None:
            return
        if len(reg.dst_pages) != s.num_pages:
            reason = (f"page count mismatch: the prefill sends {s.num_pages} pages, "
                      f"the decode side posted {len(reg.dst_pages)}")
            self._fail(s, reason, tell=reg.peer, peer_reason=reason)
            return
        with s.state.lock:
            if s.src is None:
                s.state.advance(KVPoll.WaitingForInput)
                return
            if not s.state.advance(KVPoll.Transferring):
                return
        s.out = Outgoing(reg.peer, plan_chunks(self.layout, s.num_pages, self.config.chunk_bytes))

    # ------------------------------------------------------------ data
    def pump(self) -> None:
        for s in list(self.senders.values()):
            out = s.out
            if out is None or out.done_sent:
                continue
            while out.next_seq < len(out.plan) and out.next_seq - out.credited < self.config.window_chunks:
                if not self._send_chunk(s, out):
                    break
            if out.next_seq == len(out.plan) and not out.done_sent:
                out.done_sent = self._send(out.peer, Done(s.room, len(out.plan), s.aux), s)

    def _send_chunk(self, s: TcpSender, out: Outgoing) -> bool:
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

    def _send(self, peer: bytes, msg: object, s: TcpSender | None = None, frames: list | None = None) -> bool:
        """Send to a decode peer; False when it cannot take it now (its queue is full) or is gone
        (then `s`, if given, fails)."""
        try:
            self.sock.send_multipart([peer, encode(msg), *(frames or [])], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if s is not None:
                self._fail(s, f"decode peer unreachable: {e}", tell=None)
            return False

    # ------------------------------------------------------------ time
    def on_tick(self, now: float) -> None:
        for s in list(self.senders.values()):
            reason = s.state.expired(now)
            reg = self.regs.get(s.room)
            if reason is None and reg is not None and now - self.heard.get(reg.peer, now) > self.config.peer_silence_s:
                reason = f"decode peer silent for over {self.config.peer_silence_s:g} s (heartbeat)"
            if reason is not None:
                self._fail(s, reason, tell=reg.peer if reg is not None else None)
            elif s.state.terminal:
                self.senders.pop(s.room, None)
        for room, reg in list(self.regs.items()):
            if room not in self.senders and now - reg.since > self.config.bootstrap_timeout_s:
                self.regs.pop(room)
                self._send(reg.peer, Abort(room, f"no prefill request for room {room} within "
                                                 f"{self.config.bootstrap_timeout_s:g} s"))
        self.refused = {r: v for r, v in self.refused.items() if v[1] > now}
        if now >= self.next_beat:
            self.next_beat = now + self.config.heartbeat_interval_s
            for peer in {reg.peer for reg in self.regs.values()}:
                self._send(peer, Heartbeat())
        live = {reg.peer for reg in self.regs.values()}
        self.heard = {p: t for p, t in self.heard.items() if p in live}
        self.prune()

    def _fail(self, s: TcpSender, reason: str, tell: bytes | None, peer_reason: str | None = None) -> None:
        """Fail `s` here; tell its decode peer (when known) with `peer_reason`, by default
        "peer failed: <reason>" (an Abort's reason is what the other side records, verbatim)."""
        with s.state.lock:
            failed = s.state.fail(reason)
        self.senders.pop(s.room, None)
        self.regs.pop(s.room, None)
        if failed and tell is not None:
            self._send(tell, Abort(s.room, peer_reason or f"peer failed: {reason}"))

    def close_sockets(self) -> None:
        self.sock.close(0)
