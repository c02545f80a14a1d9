"""Mid-stream failover (issue 16, item 4): a stream whose worker is lost goes on on another one.

A stream is relayed in whole SSE events (relay.py), so when its worker dies the client has an
exact, well-formed prefix of events and nothing of a half-written one. The `StreamTranscript`
keeps that prefix (with the token ids the gateway asked for); `Failover.resume` gets it with the
routed request and the lost worker and returns the rest of the stream, or None.

`ResumeFailover` reads what the client has (resume.py), asks another worker to resume from it
(the worker makes the same tokens from there: greedy, or seeded), and relays that worker's events
rewritten to read as one stream. If that worker is lost too, it goes on again from everything the
client has by then, each time on a worker not tried yet, up to the retry budget
(`--retry-max-retries`); then, or for a stream that cannot be resumed (n > 1, several prompts),
the client gets one `worker_lost` error event and [DONE]: never a hang or a torn event. A worker
that answers `resume_diverged` (it made the client's last tokens otherwise: bf16 rounding that
depends on the batch, another model behind the same name) is not the stream's continuation: its
answer is dropped, the worker is not blamed (it is healthy), and the next one is tried.
`NoFailover` (`--disable-failover`) always gives up.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Protocol

from ketch.gateway.attempt import Attempt
from ketch.gateway.metrics import GatewayMetrics
from ketch.gateway.resume import Continuation, continuation, read_so_far
from ketch.gateway.routed import RoutedRequest
from ketch.gateway.sse import DONE, diverged, lost_event, whole_events, worker_gone_at
from ketch.gateway.upstream import Answer, UpstreamError, UpstreamTimeout
from ketch.gateway.worker import Worker

# (request, body, workers to avoid) -> the attempt and its 200 answer, or why there is none
OpenContinuation = Callable[[RoutedRequest, bytes, set[str]], Awaitable[tuple[Attempt, Answer] | str]]


@dataclass
class StreamTranscript:
    keep_events: bool = False
    events: int = 0  # whole events sent to the client
    bytes_sent: int = 0
    done: bool = False  # the last event sent was [DONE]: the stream is complete
    blocks: list[bytes] = field(default_factory=list)  # the events as sent (ids kept), when keep_events

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
        """The rest of the stream (whole events as the client gets them, ending with [DONE]; it
        feeds `transcript` itself), or None: give up."""
        ...


class NoFailover:
    keep_events = False

    async def resume(self, request: RoutedRequest, transcript: StreamTranscript,
                     lost: Worker) -> AsyncIterator[bytes] | None:
        return None


class ResumeFailover:
    keep_events = True

    def __init__(self, open_continuation: OpenContinuation, metrics: GatewayMetrics, attempts: int) -> None:
        self.open, self.metrics, self.attempts = open_continuation, metrics, attempts

    async def resume(self, request: RoutedRequest, transcript: StreamTranscript,
                     lost: Worker) -> AsyncIterator[bytes] | None:
        if request.fields is None:
            self.metrics.failovers.labels("not_resumable").inc()
            return None
        return self._rest(request, transcript, lost)

    async def _rest(self, request: RoutedRequest, transcript: StreamTranscript, lost: Worker) -> AsyncIterator[bytes]:
        tried, why = {lost.url}, []  # why each try ended: the client's worker_lost event says them all
        for _ in range(self.attempts):
            so = read_so_far(transcript.blocks)
            plan = continuation(request.fields, so)
            self.metrics.failover_tokens.inc(len(so.ids))
            opened = await self.open(request, plan.body, tried)
            if isinstance(opened, str):
                why.append(opened)
                break
            attempt, answer = opened
            tried.add(attempt.worker.url)
            rewrite = Continuation(so, plan, request.strip_ids)
            forked = False
            try:
                async for block in whole_events(answer.chunks()):
                    if diverged(block):  # its error comes before any of its text: nothing was sent
                        forked = True
                        break
                    gone = worker_gone_at(block)  # it is going too: the rest stays back, as in relay.py
                    kept, sent = rewrite(block if gone < 0 else block[:gone])
                    if kept:
                        transcript.feed(kept)
                    if sent:
                        yield sent
                    if gone >= 0:
                        break
            except UpstreamError as e:
                attempt.failed("timeout" if isinstance(e, UpstreamTimeout) else "stream_cut")
                why.append(f"{attempt.worker.url} was lost too")
                continue
            finally:  # also when the client leaves: closing the socket tells the worker
                answer.close()
                attempt.close()
            if transcript.done:
                self.metrics.failovers.labels("resumed").inc()
                return
            if forked:
                self.metrics.failover_diverged.inc()
                why.append(f"{attempt.worker.url} could not continue it exactly (resume_diverged)")
                continue
            attempt.failed("stream_cut")
            why.append(f"{attempt.worker.url} closed it before [DONE] too")
        self.metrics.failovers.labels("gave_up").inc()
        yield lost_event(lost.url, "; ".join(why) or "no worker could continue it")
