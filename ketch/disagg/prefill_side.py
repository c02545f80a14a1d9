"""The prefill side of a PD pair, whatever moves the bytes: the bootstrap server and the senders'
states, on one background thread (io_loop.py). tcp_prefill.py, nixl_prefill.py and
mooncake_prefill.py add the data.

The bootstrap server is a ZMQ ROUTER on `bootstrap_port`. A decode side registers a room there
(Hello with its KV layout and backend, then Post with its pre-allocated pages); the prefill
engine's sender for that room looks the registration up when it is created, or is attached when
it arrives (the gateway sends a request to both servers at once: either may come first). The
sender's Success is the decode side's Received: every byte is there.

A registration nobody claims within bootstrap_timeout_s is refused (Abort) and dropped, so a
decode side never waits for a prefill request that will not come. ROUTER_MANDATORY turns a send
to a vanished decode process into an error (its room fails at once) instead of a silent drop.

While a decode side may be reading this side's pages by itself (nixl, mooncake: after Ready), failing the
room is deferred: the peer is told to stop, and the room reaches Failed (its pages free) when the
peer says Released, Received or Abort, or falls silent past the heartbeat.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import torch
import zmq

from ketch.disagg.config import DisaggConfig
from ketch.disagg.io_loop import IOLoop, tcp_endpoint
from ketch.disagg.layout import KVLayout, layout_of, num_pages_of
from ketch.disagg.prefill_sender import PrefillSender, Registration
from ketch.disagg.state import KVPoll
from ketch.disagg.transport import Aux, KVReceiver, KVTransport
from ketch.disagg.wire import (Abort, Heartbeat, Hello, Post, Ready, Received, Released, Welcome, decode_to_prefill,
                               encode)

log = logging.getLogger(__name__)


class PrefillSide(IOLoop, KVTransport):
    backend = ""  # the data plane's name, as decode sides must name it in their Hello

    def __init__(self, config: DisaggConfig, layers: list[dict[str, torch.Tensor]], model: str = "") -> None:
        if config.mode != "prefill":
            raise ValueError(f"mode: a prefill transport needs mode 'prefill', got {config.mode!r}")
        super().__init__(f"disagg-{self.backend}-prefill", tick_s=min(0.1, config.heartbeat_interval_s / 2))
        self.config = config
        self.layers = layers
        self.layout: KVLayout = layout_of(layers, model)
        self.pool_pages = num_pages_of(layers)
        self.device = next(iter(layers[0].values())).device
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        host = config.bootstrap_host
        try:
            if config.bootstrap_port == 0:
                port = self.sock.bind_to_random_port(tcp_endpoint(host))
            else:
                port = config.bootstrap_port
                self.sock.bind(tcp_endpoint(host, port))
        except zmq.ZMQError as e:  # an address this machine does not have, a port in use: name the flags
            self.discard()
            raise ValueError(f"disaggregation_bootstrap_host / _port: cannot listen on {host}:{config.bootstrap_port}: "
                             f"{e}") from None
        self._addr = f"{host}:{port}"
        self.poller.register(self.sock, zmq.POLLIN)
        # loop thread only, from here on
        self.senders: dict[int, PrefillSender] = {}
        self.regs: dict[int, Registration] = {}
        self.refused: dict[int, tuple[str, float]] = {}  # room -> (reason, until): for a sender that comes later
        self.heard: dict[bytes, float] = {}  # peer -> when it last said anything
        self.next_beat = 0.0

    # ------------------------------------------------------------ what a data plane implements
    def _start(self, s: PrefillSender, reg: Registration) -> None:
        """Start moving s's ready rows to reg's pages (s is Transferring, s.rows not empty)."""
        raise NotImplementedError

    def _grow(self, s: PrefillSender) -> None:
        """s.rows grew, or s became complete, after `_start`: move the new rows too (and end
        the transfer once s is complete)."""
        raise NotImplementedError

    def _welcome(self, room: int) -> Welcome:
        return Welcome(room)

    def _on_data(self, peer: bytes, s: PrefillSender | None, msg: object) -> None:
        """A data-plane message about a room of `peer` (s: its sender, if any)."""

    def _may_succeed(self, s: PrefillSender) -> bool:
        """Whether a Received for s confirms a whole transfer (not one this side never finished)."""
        return s.final_announced

    def _start_peer_read(self, s: PrefillSender, reg: Registration) -> None:
        """`_start` of a data plane whose decode side READs the pages itself (nixl, mooncake):
        Ready(src pages, Aux); from then on a failure here waits for the peer's word."""
        with s.state.lock:  # first: an abort from now on waits for the decode side's word
            if s.state.terminal:
                return
            s.peer_reads = True
        s.out = reg.peer
        if self._announce(s):
            return
        with s.state.lock:  # the Ready never left: nobody reads the pages
            s.peer_reads = False
            if s.aborting is not None:
                s.state.fail(s.aborting)
        if not s.state.terminal:
            self._fail(s, "decode peer not taking messages (its queue is full)", tell=reg.peer)

    def _announce(self, s: PrefillSender) -> bool:
        """`_grow` of a peer-read data plane: Ready for the rows not named yet (a part, or the
        last one with the Aux once s is complete). False when the peer cannot take it now."""
        if s.final_announced or s.aborting is not None:
            return True
        final = s.complete
        # The last row goes out with the Aux (the decode side takes a Ready that reaches the last
        # page only as the final one): parts that cover every row before send() leave it for then.
        upto = len(s.rows) if final else min(len(s.rows), s.num_pages - 1)
        if not final and upto <= s.announced:
            return True
        msg = Ready(s.room, s.rows[s.announced:upto], s.aux if final else None, s.announced)
        if not self._send(s.out, msg, s):
            return False
        s.announced, s.final_announced = upto, final
        return True

    def _grow_peer_read(self, s: PrefillSender) -> None:
        if not self._announce(s) and not s.state.terminal:  # pages of earlier parts may be read: wait for the peer
            self._fail(s, "decode peer not taking messages (its queue is full)", tell=s.out)

    # ------------------------------------------------------------ the engine's side
    @property
    def bootstrap_addr(self) -> str:
        return self._addr

    def sender(self, room: int) -> PrefillSender:
        return PrefillSender(room, self)

    def receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        raise RuntimeError("a prefill transport only sends: receivers live on a decode transport")

    def submit(self, sender: PrefillSender, fn: Callable[..., None], *args: object) -> None:
        self.track(sender.state)
        if not self.call(fn, sender, *args):
            with sender.state.lock:
                sender.state.fail(sender.aborting or "transport closed")

    def close(self) -> None:
        self.stop()

    # ------------------------------------------------------------ commands (loop thread)
    def _on_init(self, s: PrefillSender) -> None:
        if s.room in self.senders:  # a second request in an open room: its KV must not reach the first's peer
            self._fail(s, f"room {s.room} is open already on this prefill side", tell=None)
            return
        self.senders[s.room] = s
        refused = self.refused.pop(s.room, None)
        if refused is not None:
            self._fail(s, refused[0], tell=None)
        else:
            self._attach(s)

    def _on_part(self, s: PrefillSender, pages: list[int], done: Callable[[], bool] | None) -> None:
        s.pending.append((pages, done))
        self._advance(s)

    def _on_send(self, s: PrefillSender, pages: list[int], aux: Aux) -> None:
        s.pending.append((pages, None))
        s.aux = aux
        self._advance(s)

    def _advance(self, s: PrefillSender) -> None:
        """Rows whose device work is over are ready: start or grow the transfer with them."""
        if s.state.terminal or not s.take_ready():
            return
        if s.out is None:
            self._attach(s)
        else:
            self._grow(s)

    def pump(self) -> None:
        for s in [s for s in self.senders.values() if s.waiting_on_device]:
            self._advance(s)

    def busy(self) -> bool:
        return any(s.waiting_on_device for s in self.senders.values())

    def _tell_abort(self, s: PrefillSender, reason: str) -> None:
        reg = self.regs.get(s.room)
        if reg is not None:
            self._send(reg.peer, Abort(s.room, reason))
        else:  # the decode side has not registered yet: refuse it when it does
            self.refused[s.room] = (reason, time.monotonic() + self.config.bootstrap_timeout_s)
        if s.aborting is None:
            self._forget(s)
        elif reg is None:  # nobody can be reading the pages
            self._quiesced(s)
        else:
            s.abort_deadline = time.monotonic() + self.config.peer_silence_s

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
        if reg is None or reg.peer != peer:
            return  # a room this peer has not registered (or no longer holds): not its to change
        s = self.senders.get(msg.room)
        if s is not None and s.aborting is not None and isinstance(msg, (Received, Released, Abort)):
            self._quiesced(s)  # the peer has stopped reading: the pages may go
        elif isinstance(msg, Post):
            if reg is not None:
                reg.dst_pages = list(msg.dst_pages)
                if s is not None:
                    self._attach(s)
        elif isinstance(msg, Received):
            if s is None or not self._may_succeed(s):
                if s is not None:
                    self._fail(s, "the decode side confirmed a transfer this side had not finished", tell=reg.peer)
                self._forget_room(msg.room)
                return
            with s.state.lock:
                s.state.advance(KVPoll.Success)
            self._forget_room(msg.room)
        elif isinstance(msg, Abort):
            self.regs.pop(msg.room, None)
            if s is not None:
                self._fail(s, msg.reason, tell=None)
            else:  # the decode side gave up before this side's request came: refuse the sender then
                self.refused[msg.room] = (msg.reason, time.monotonic() + self.config.bootstrap_timeout_s)
        elif not isinstance(msg, Released):
            self._on_data(peer, s, msg)

    def _hello(self, peer: bytes, msg: Hello) -> None:
        if msg.room in self.regs:  # a second decode request for a room: refuse it, leave the first alone
            self._send(peer, Abort(msg.room, f"room {msg.room} is registered already by another decode request"))
            return
        if msg.room in self.refused:  # aborted or refused here before this decode side registered
            self._send(peer, Abort(msg.room, self.refused[msg.room][0]))
            return
        problem = self.layout.difference(msg.layout, "at the prefill side", "at the decode side")
        if msg.backend != self.backend:
            problem = f"backend mismatch: {self.backend!r} at the prefill side, {msg.backend!r} at the decode side"
        if problem is not None:
            self._send(peer, Abort(msg.room, problem))
            s = self.senders.get(msg.room)
            if s is not None:
                self._fail(s, problem, tell=None)
            else:
                self.refused[msg.room] = (problem, time.monotonic() + self.config.bootstrap_timeout_s)
            return
        self.regs[msg.room] = Registration(peer, time.monotonic())
        self._send(peer, self._welcome(msg.room))

    def _attach(self, s: PrefillSender) -> None:
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
            if not s.rows:
                s.state.advance(KVPoll.WaitingForInput)
                return
            if not s.state.advance(KVPoll.Transferring):
                return
        self._start(s, reg)

    def _send(self, peer: bytes, msg: object, s: PrefillSender | None = None, frames: list | None = None) -> bool:
        """Send to a decode peer; False when it cannot take it now (its queue is full) or is gone
        (then `s`, if given, fails)."""
        try:
            self.sock.send_multipart([peer, encode(msg), *(frames or [])], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if s is not None:
                self._fail(s, f"decode peer unreachable: {e}", tell=None, peer_gone=True)
            return False

    # ------------------------------------------------------------ time
    def on_tick(self, now: float) -> None:
        for s in list(self.senders.values()):
            reg = self.regs.get(s.room)
            silent = reg is not None and now - self.heard.get(reg.peer, now) > self.config.peer_silence_s
            if s.aborting is not None:
                if silent or now > s.abort_deadline:
                    self._quiesced(s)
                continue
            reason = s.state.expired(now)
            if reason is None and silent:
                reason = f"decode peer silent for over {self.config.peer_silence_s:g} s (heartbeat)"
            if reason is not None:
                self._fail(s, reason, tell=reg.peer if reg is not None else None, peer_gone=silent)
            elif s.state.terminal:
                self._forget(s)
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

    def _fail(self, s: PrefillSender, reason: str, tell: bytes | None, peer_reason: str | None = None,
              peer_gone: bool = False) -> None:
        """Fail `s` here; tell its decode peer (when known) with `peer_reason`, by default
        "peer failed: <reason>" (an Abort's reason is what the other side records, verbatim).
        While the peer may read the pages (and is not gone), Failed waits for it to stop."""
        with s.state.lock:
            if s.state.terminal or s.aborting is not None:
                return
            wait = s.peer_reads and tell is not None and not peer_gone
            if wait:
                s.aborting = reason
            else:
                s.state.fail(reason)
        if tell is not None:
            self._send(tell, Abort(s.room, peer_reason or f"peer failed: {reason}"))
        if wait:
            s.abort_deadline = time.monotonic() + self.config.peer_silence_s
        else:
            self._forget(s)

    def _quiesced(self, s: PrefillSender) -> None:
        """The peer no longer reads s's pages (or is presumed dead): the deferred failure lands."""
        with s.state.lock:
            s.state.fail(s.aborting or "aborted")
        self._forget(s)

    def _forget(self, s: PrefillSender) -> None:
        if self.senders.get(s.room) is s:
            self._forget_room(s.room)

    def _forget_room(self, room: int) -> None:
        self.senders.pop(room, None)
        self.regs.pop(room, None)

    def close_sockets(self) -> None:
        self.sock.close(0)
