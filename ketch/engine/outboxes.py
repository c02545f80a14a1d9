"""The engine process's output side: one PUSH socket per API process (`--api-server-count`).

A request's outputs, errors, pongs and flush answers go back to the API process that sent it (the
`origin` of its GenerateRequest / Ping / FlushCache); what every API process must know (EngineReady, EngineError) goes to
all. With one API process there is one socket and no routing at all: a step's deltas are one
TokenOutputs message, as before.
"""
from __future__ import annotations

from collections.abc import Container, Sequence

import zmq

from ketch.engine import messages as m


class Outboxes:
    def __init__(self, socks: Sequence[zmq.Socket]) -> None:
        """socks: one connected PUSH socket per API process, in origin order."""
        self.socks = list(socks)
        self._owner: dict[str, int] = {}  # request id -> origin, for requests not yet finished

    @classmethod
    def connect(cls, zctx: zmq.Context, addrs: Sequence[str]) -> "Outboxes":
        socks = []
        for addr in addrs:
            sock = zctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)  # let the last message (e.g. EngineError) leave before exit
            sock.connect(addr)
            socks.append(sock)
        return cls(socks)

    def send_all(self, msg: m.FromEngine) -> None:
        data = m.encode(msg)
        for sock in self.socks:
            sock.send(data)

    def send_to(self, origin: int, msg: m.FromEngine) -> None:
        """To one API process; an origin no socket serves is a protocol error (KeyError-like)."""
        self.socks[origin].send(m.encode(msg))

    def owned(self, request_id: str, origin: int) -> None:
        """The engine accepted `request_id` from `origin`: its outputs go there until it ends."""
        if len(self.socks) > 1:
            self._owner[request_id] = origin

    def send_outputs(self, deltas: list[m.TokenDelta], live: Container[str]) -> None:
        """One step's deltas, one message per API process that has any; `live`: the ids the engine
        still runs (an id that finished and is not live is forgotten here)."""
        if len(self.socks) == 1:
            self.socks[0].send(m.encode(m.TokenOutputs(deltas)))
            return
        by_origin: dict[int, list[m.TokenDelta]] = {}
        for delta in deltas:
            rid = delta.request_id
            by_origin.setdefault(self._owner.get(rid, 0), []).append(delta)
            if delta.finished and rid not in live:
                self._owner.pop(rid, None)
        for origin, part in by_origin.items():
            self.socks[origin].send(m.encode(m.TokenOutputs(part)))

    def forget_unless(self, live: Container[str]) -> None:
        """Drop owners of requests that ended without a finished delta reaching send_outputs."""
        for rid in [rid for rid in self._owner if rid not in live]:
            del self._owner[rid]

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
