"""The seam for mid-stream failover (issue 16, item 4: not done yet).

A stream is relayed in whole SSE events (relay.py), so when its worker dies the client has
received an exact, well-formed prefix of events and nothing of a half-written one. The
`StreamTranscript` records that prefix; a `Failover` gets it with the routed request and the lost
worker and may return the rest of the stream (events from another worker that continue the same
choices), which the relay then sends on after what the client already has.

Today `NoFailover` answers None: the client gets one error event (`worker_lost`) and
`data: [DONE]`, never a hang or a torn event. A real failover sets `keep_events` so the
transcript keeps the relayed events (it needs each choice's text so far to build the
continuation request for another worker; the engine side of that is the `resume` branch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from ketch.gateway.routed import RoutedRequest
from ketch.gateway.worker import Worker

DONE = b"data: [DONE]"


@dataclass
class StreamTranscript:
    keep_events: bool = False
    events: int = 0  # whole events sent to the client
    bytes_sent: int = 0
    done: bool = False  # the last event sent was [DONE]: the stream is complete
    blocks: list[bytes] = field(default_factory=list)  # the events as sent, when keep_events

    def feed(self, block: bytes) -> None:
        """`block`: one or more whole events (each ends with a blank line), as sent to the client."""
        self.events += block.count(b"\n\n")
        self.bytes_sent += len(block)
        self.done = block.rstrip().endswith(DONE)
        if self.keep_events:
            self.blocks.append(block)


class Failover(Protocol):
    keep_events: bool

    async def resume(self, request: RoutedRequest, transcript: StreamTranscript,
                     lost: Worker) -> AsyncIterator[bytes] | None:
        """The rest of the stream (whole events, ending with [DONE]), or None: give up."""
        ...


class NoFailover:
    keep_events = False

    async def resume(self, request: RoutedRequest, transcript: StreamTranscript,
                     lost: Worker) -> AsyncIterator[bytes] | None:
        return None
