"""The KVTransport contract (ARCHITECTURE.md, "Contracts"): one sender per room on the prefill
side, one receiver per room on the decode side, one transport object per process that makes them.

    prefill (engine thread)                        decode (engine thread)
    s = t.sender(room); s.init(n)                  r = t.receiver(room, bootstrap_addr); r.init()
      poll: Bootstrapping                          r.post_buffers(dst_pages)   (n pre-allocated pages)
      ... prompt runs ...                            poll: Bootstrapping → WaitingForInput
      poll: WaitingForInput (decode registered)
      s.send_part(full pages so far)  (optional, after each prompt chunk: Transferring starts)
    s.send(src_pages, Aux(first_token))            poll: Transferring → Success; r.aux has the token
      poll: Transferring → Success (decode confirmed: now free src_pages)

Every method returns at once: the network work runs on the transport's background thread, and
`poll` is an attribute read. `abort` on either side fails the other side too. The engine frees
a room's pages when poll() says Failed or Success, never earlier (not on `abort` itself): from
then on the transport touches none of them. That is at once after an abort for tcp, fake and
mooncake (its READ fills a staging buffer of the room's own); for nixl, once a READ that may
still touch the pages is cancelled or over. A sender reaches
Success only after the receiver confirmed every byte written, so the prefill side never frees
pages a decode side still needs (PRIOR_ART known failure 5).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import msgspec

from ketch.disagg.state import KVPoll, TransferState


class Aux(msgspec.Struct, frozen=True):
    """What travels with the KV besides the pages: the first token the prefill side sampled, and
    room for more (sampling state, logprobs) as bytes the engine encodes itself."""

    first_token: int
    extra: bytes = b""


class _Room(ABC):
    """What both ends of a room share: its id and its state, which `poll` and `failure` read
    (the background thread moves it; a read is all the engine thread does)."""

    room: int
    state: TransferState

    def poll(self) -> KVPoll:
        return self.state.state

    @property
    def failure(self) -> str | None:
        """Why the room failed (None unless poll() is Failed)."""
        return self.state.reason


class KVSender(_Room):

    @abstractmethod
    def init(self, num_pages: int) -> None:
        """Start looking for the decode side's registration of this room; `num_pages` pages will
        be sent (the decode side must have posted as many)."""

    def send_part(self, src_pages: list[int], done: Callable[[], bool] | None = None) -> None:
        """Pipelining: the transfer's next `len(src_pages)` rows (after those of earlier parts)
        hold their final KV already (a prompt chunk ended), so they may move while the rest of the
        prompt runs. `done`: whether the device work writing them is over (a CUDA event's query;
        None: it is); nothing of them is read before. Any number of times before `send`; the
        engine keeps the pages alive until poll() is terminal, as with `send`. A backend that
        cannot move part of a room sends them with `send`: the default does nothing."""

    @abstractmethod
    def send(self, src_pages: list[int], aux: Aux) -> None:
        """Send rows `src_pages` of every tensor of every layer, then `aux`. Allowed while still
        Bootstrapping: the transfer starts once the decode side registered. Once. `src_pages`
        lists every page of the transfer; the rows that earlier `send_part` calls gave are not
        read from it again (after a preemption the prompt may sit in other pages by now)."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Fail this room here ("aborted: reason") and at the peer ("peer aborted: reason");
        poll() is Failed once no page of it is read any more."""


class KVReceiver(_Room):

    @abstractmethod
    def init(self) -> None:
        """Start the handshake with the prefill side's bootstrap server."""

    @abstractmethod
    def post_buffers(self, dst_pages: list[int]) -> None:
        """The pre-allocated pages the KV goes into, in the sender's page order. Once."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Fail this room here and at the peer; poll() is Failed once no page of it is written any more."""

    @property
    @abstractmethod
    def aux(self) -> Aux | None:
        """The sender's Aux once poll() is Success, else None."""


class KVTransport(ABC):
    """One per engine process (and TP rank): owns the sockets and the background thread."""

    @property
    def carries_kv(self) -> bool:
        """False for a decode side that will never receive KV (the fake backend across processes):
        its engine runs each prompt itself instead of waiting for pages that cannot come."""
        return True

    @abstractmethod
    def sender(self, room: int) -> KVSender: ...

    @abstractmethod
    def receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        """bootstrap_addr: "host:port" of the prefill side's bootstrap server (from the request)."""

    @property
    @abstractmethod
    def bootstrap_addr(self) -> str | None:
        """Prefill: where decode sides register ("host:port"); decode: None."""

    @abstractmethod
    def close(self) -> None:
        """Stop the background thread; rooms still open are failed ("transport closed")."""
