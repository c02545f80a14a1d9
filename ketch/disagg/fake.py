"""The `fake` backend: moves no bytes. For tests of the state machine and for warm-up requests.

A FakeTransport without a hub is a lone side. A lone prefill side's sender is WaitingForInput as
soon as it is initialised and Success as soon as it sends (SGLang's fake sender does the same),
so a warm-up request runs the whole prefill path with no decode server. A lone decode side
`carries_kv` False: its engine runs each prompt itself rather than wait for bytes that never
come, so a gateway over fake-backend servers answers exactly as a colocated server would (the
PD request path, rooms and all, minus the transfer: SGLang's fake decode side would decode
from unwritten pages instead). Transports sharing a
`FakeHub` (one process, a prefill and a decode transport) pair their rooms: a sender waits for
the receiver's posted buffers, the receiver for the send; both reach Success together, the
receiver with the sender's Aux (its pages are left as they are). Abort and the timeouts behave
as in the real backends; with no thread, `poll` checks the deadline itself.
"""
from __future__ import annotations

import threading
import time

from ketch.disagg.config import DisaggConfig
from ketch.disagg.state import KVPoll, TransferState, timeouts_of
from ketch.disagg.transport import Aux, KVReceiver, KVSender, KVTransport


class FakeHub:
    """Rooms of the senders and receivers of the transports that share it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.senders: dict[int, FakeSender] = {}
        self.receivers: dict[int, FakeReceiver] = {}


class _FakeSide:
    def __init__(self, room: int, config: DisaggConfig, hub: FakeHub | None) -> None:
        self.room = room
        self.hub = hub
        self.state = TransferState(timeouts_of(config))

    def poll(self) -> KVPoll:
        reason = self.state.expired(time.monotonic())
        if reason is not None:
            self._fail(reason, notify=f"peer failed: {reason}")
        return self.state.state

    def abort(self, reason: str) -> None:
        self._fail(f"aborted: {reason}", notify=f"peer aborted: {reason}")

    def _peer(self) -> _FakeSide | None:
        raise NotImplementedError

    def _fail(self, reason: str, notify: str) -> None:
        with self.state.lock:
            failed = self.state.fail(reason)
        peer = self._peer()
        if failed and peer is not None:
            with peer.state.lock:
                peer.state.fail(notify)


class FakeSender(_FakeSide, KVSender):
    def __init__(self, room: int, config: DisaggConfig, hub: FakeHub | None) -> None:
        super().__init__(room, config, hub)
        self.num_pages = 0  # 0: init not called yet
        self.sent: Aux | None = None

    def _peer(self) -> FakeReceiver | None:
        return None if self.hub is None else self.hub.receivers.get(self.room)

    def init(self, num_pages: int) -> None:
        self.num_pages = num_pages
        if self.hub is None:
            with self.state.lock:
                self.state.advance(KVPoll.WaitingForInput)
            return
        with self.hub.lock:
            self.hub.senders[self.room] = self
            _match(self, self.hub.receivers.get(self.room))

    def send(self, src_pages: list[int], aux: Aux) -> None:
        if self.sent is not None:
            raise RuntimeError(f"room {self.room}: send called twice")
        if len(src_pages) != self.num_pages:
            raise ValueError(f"src_pages: {len(src_pages)} pages, init said {self.num_pages}")
        self.sent = aux
        if self.hub is None:
            with self.state.lock:
                self.state.advance(KVPoll.Success)
            return
        with self.hub.lock:
            _match(self, self.hub.receivers.get(self.room))


class FakeReceiver(_FakeSide, KVReceiver):
    def __init__(self, room: int, config: DisaggConfig, hub: FakeHub | None) -> None:
        super().__init__(room, config, hub)
        self.dst_pages: list[int] | None = None
        self._aux: Aux | None = None

    def _peer(self) -> FakeSender | None:
        return None if self.hub is None else self.hub.senders.get(self.room)

    @property
    def aux(self) -> Aux | None:
        return self._aux if self.state.state == KVPoll.Success else None

    def init(self) -> None:
        if self.hub is None:
            raise RuntimeError("a fake receiver needs a FakeHub shared with a fake prefill transport")
        with self.hub.lock:
            self.hub.receivers[self.room] = self

    def post_buffers(self, dst_pages: list[int]) -> None:
        if self.dst_pages is not None:
            raise RuntimeError(f"room {self.room}: post_buffers called twice")
        self.dst_pages = list(dst_pages)
        with self.hub.lock:
            _match(self.hub.senders.get(self.room), self)


def _match(sender: FakeSender | None, receiver: FakeReceiver | None) -> None:
    """Both sides ready: WaitingForInput; the KV sent as well: Success on both (hub lock held)."""
    if sender is None or receiver is None or receiver.dst_pages is None or sender.num_pages == 0:
        return
    with sender.state.lock, receiver.state.lock:
        if sender.state.terminal or receiver.state.terminal:
            return
        if len(receiver.dst_pages) != sender.num_pages:
            reason = f"page count mismatch: sender has {sender.num_pages}, receiver posted {len(receiver.dst_pages)}"
            sender.state.fail(reason)
            receiver.state.fail(reason)
            return
        if sender.sent is None:
            sender.state.advance(KVPoll.WaitingForInput)
            receiver.state.advance(KVPoll.WaitingForInput)
            return
        receiver._aux = sender.sent
        receiver.state.advance(KVPoll.Success)
        sender.state.advance(KVPoll.Success)


class FakeTransport(KVTransport):
    def __init__(self, config: DisaggConfig, hub: FakeHub | None = None) -> None:
        self.config = config
        self.hub = hub
        self._sides: list[_FakeSide] = []  # what close() fails (this transport's rooms, not the peer's)

    def sender(self, room: int) -> FakeSender:
        self._prune()
        self._sides.append(FakeSender(room, self.config, self.hub))
        return self._sides[-1]

    def receiver(self, room: int, bootstrap_addr: str) -> FakeReceiver:
        self._prune()
        self._sides.append(FakeReceiver(room, self.config, self.hub))
        return self._sides[-1]

    def _prune(self) -> None:
        self._sides = [side for side in self._sides if not side.state.terminal]

    @property
    def carries_kv(self) -> bool:
        return self.hub is not None

    @property
    def bootstrap_addr(self) -> str | None:
        return "fake" if self.config.mode == "prefill" else None

    def close(self) -> None:
        for side in self._sides:
            side._fail("transport closed", notify="peer failed: its transport closed")
        self._sides.clear()
