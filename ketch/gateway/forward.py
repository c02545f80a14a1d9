"""Send a request to a worker the policy picks; when it reaches none, try another.

    attempt 1..N (N = --retry-max-retries), each to a worker not tried yet, backoff in between:
      no worker left to try           ─▶ 503 no_available_workers (at once: never waits for one)
      connect refused / lost before   ─▶ charged to the worker, next attempt
        an answer / 502 / 503
      429 (the worker's queue full)   ─▶ next attempt, not charged (busy is not broken); when
                                         every worker tried was busy: 429 with their Retry-After
      silent past the timeout         ─▶ charged to the worker, 504 (it may still be working:
                                         the request is not sent twice); a plain GET (no side
                                         effect, answered at once by a healthy worker) waits the
                                         health check's timeout, then goes to the next worker
      any other answer                ─▶ relayed as it is (status, headers, body), 4xx and 5xx too

Why those retry: a refused connection or a 502/503 (the worker shutting down, its engine gone)
means the worker did not take the request, so another may; so does a 429, which a worker gives
before it takes anything (its admission count is full) while another may have room; a reset
before any answer means it died with it, and a generation has no side effect worth protecting.
Once the client has a byte of the answer nothing is retried here: a stream whose worker is lost
goes on elsewhere from what the client has (failover.py, through `continuation`).
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

from starlette.responses import Response

from ketch.gateway.attempt import Attempt
from ketch.gateway.body import Receive
from ketch.gateway.config import GatewayConfig
from ketch.gateway.errors import GatewayError, all_busy, unavailable
from ketch.gateway.failover import Failover
from ketch.gateway.metrics import GatewayMetrics
from ketch.gateway.policies import RoutingPolicy
from ketch.gateway.policies.base import Choice
from ketch.gateway.registry import WorkerRegistry
from ketch.gateway.relay import Send, relay, whole_response
from ketch.gateway.routed import RoutedRequest
from ketch.gateway.upstream import Answer, ConnectFailed, Upstream, UpstreamError, UpstreamTimeout
from ketch.gateway.worker import Worker

Opened = tuple[Attempt, Answer]  # a worker's answer (status and headers read, body not) and its attempt

RETRY_STATUSES = frozenset({502, 503})
BUSY_STATUS = 429
_ERROR_BODY_PREVIEW = 300  # characters of a refused answer quoted in the final 503 / 429
_DEFAULT_RETRY_AFTER = "1"  # a busy worker that sent none (ketch serve sends one)


@dataclass
class Refusals:
    """Why the workers tried so far did not take a request: failures (down, lost, 502/503) and
    busy ones (429), with the shortest Retry-After those sent."""

    failures: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    retry_after: int | None = None

    def add_busy(self, why: str, retry_after: bytes | None) -> None:
        self.busy.append(why)
        try:
            seconds = max(0, int(retry_after)) if retry_after is not None else None
        except ValueError:  # an HTTP date: not parsed, the default stands
            seconds = None
        if seconds is not None and (self.retry_after is None or seconds < self.retry_after):
            self.retry_after = seconds


def backoff_seconds(retry: int, initial_ms: float, max_ms: float, multiplier: float, jitter: float,
                    rng: random.Random) -> float:
    """Before the `retry`-th retry (1, 2, ...): initial × multiplier^(retry-1), capped, ± jitter."""
    base = min(max_ms, initial_ms * multiplier ** (retry - 1))
    return base * (1 + jitter * rng.uniform(-1.0, 1.0)) / 1000.0


class Forwarder:
    def __init__(self, upstream: Upstream, registry: WorkerRegistry, policy: RoutingPolicy,
                 metrics: GatewayMetrics, config: GatewayConfig, failover: Failover,
                 clock: Callable[[], float], rng: random.Random | None = None, role: str | None = None) -> None:
        self.upstream, self.registry, self.policy, self.metrics = upstream, registry, policy, metrics
        self.role = role  # the workers it sends to (PD mode: "decode", for GET /v1/models); None: all
        self.config, self.failover, self.clock = config, failover, clock
        self.rng = rng or random.Random()

    async def respond(self, request: RoutedRequest, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """Answer one generation request (generate.py): a worker's answer relayed, or the error."""
        opened = await self.generation(request)
        if isinstance(opened, GatewayError):
            await opened.response()(scope, receive, send)
        else:
            await relay(send, *opened, request, self.failover)

    async def generation(self, request: RoutedRequest) -> Opened | GatewayError:
        """The answer of the worker the policy picked (or the next one, retried), else why none.
        The caller relays it; a client leaving meanwhile cancels this, which closes the attempt."""
        return await self._forward(self._picker(request), "POST", request.path, request.body, request.route,
                                   request_id=request.request_id)

    async def continuation(self, request: RoutedRequest, body: bytes, exclude: set[str]) -> Opened | str:
        """A stream that goes on from a lost worker's (failover.py): `body` to a worker not in
        `exclude`, picked and retried as any request. Its 200 answer, still unread; or why not."""
        opened = await self._forward(self._picker(request), "POST", request.path, body, request.route, exclude,
                                     request.request_id)
        if isinstance(opened, GatewayError):  # no worker took it (503), or one timed out (504)
            return opened.message
        attempt, answer = opened
        if answer.status_code == 200:
            return opened
        # refused (a 4xx: the resume request itself; a 500): not worth another worker
        return f"{attempt.worker.url} refused it: {await _refused(attempt, answer)}"

    def _picker(self, request: RoutedRequest) -> Callable[[Sequence[Worker]], Choice]:
        def pick(workers: Sequence[Worker]) -> Choice:
            choice = self.policy.pick(request, workers)
            self.metrics.routed(self.policy.name, choice)
            return choice
        return pick

    async def plain(self, method: str, path: str, route: str) -> Response:
        """A request with nothing to route by (GET /v1/models): the least loaded worker, policy
        state untouched; the answer read whole and passed on. `route`: the metrics label (the
        route's template, never a client-chosen path: each distinct label is a new series)."""
        opened = await self._forward(lambda ws: Choice(min(ws, key=lambda w: w.load), "least_load"), method, path,
                                     None, route, read_timeout=self._plain_timeout())
        if isinstance(opened, GatewayError):
            return opened.response()
        attempt, answer = opened
        try:
            body = await answer.read()
        except UpstreamError as e:
            attempt.failed("timeout" if isinstance(e, UpstreamTimeout) else "stream_cut")
            return unavailable(f"the worker {attempt.worker.url} was lost while answering: {e}", "worker_lost").response()
        finally:
            answer.close()
            attempt.close()
        return whole_response(answer, attempt, body)

    def _plain_timeout(self) -> float:
        """A plain route's silence limit: a hung worker (stopped, its event loop stuck) must not hold
        GET /v1/models for the generation timeout (30 min by default) while others could answer."""
        return min(self.config.request_timeout_secs, self.config.health.check_timeout_secs)

    async def _forward(self, pick: Callable[[Sequence[Worker]], Choice], method: str, path: str,
                       body: bytes | None, route: str, exclude: Collection[str] = (),
                       request_id: str | None = None, read_timeout: float | None = None) -> Opened | GatewayError:
        """The first answer a worker gave (its attempt open: the caller closes both), else the error.
        request_id: sent as the worker's x-request-id (every attempt: one request, retried).
        read_timeout: given for a request with no side effect, whose silence is then one more
        failure to try another worker after (None: the generation timeout, a 504 at once)."""
        tried: set[str] = set(exclude)
        refusals = Refusals()
        retry = self.config.retry
        for attempt_no in range(retry.attempts):
            workers = self.registry.available(exclude=tried, role=self.role)
            if not workers:
                break
            if attempt_no:
                self.metrics.retries.inc()
                await asyncio.sleep(backoff_seconds(attempt_no, retry.initial_backoff_ms, retry.max_backoff_ms,
                                                    retry.backoff_multiplier, retry.jitter_factor, self.rng))
                # a worker may have left or failed meanwhile: pick among those still available
                workers = self.registry.available(exclude=tried, role=self.role)
                if not workers:
                    break
            choice = pick(workers)
            tried.add(choice.worker.url)
            attempt = Attempt(choice.worker, route, self.metrics, self.clock)
            outcome = await self._try(attempt, method, path, body, refusals, request_id, read_timeout)
            if choice.unlearn is not None and not _taken(outcome):
                choice.unlearn()
            if outcome is not None:
                return outcome
        if refusals.busy and not refusals.failures:
            retry_after = _DEFAULT_RETRY_AFTER if refusals.retry_after is None else str(refusals.retry_after)
            return all_busy("every worker tried is at capacity: " + "; ".join(refusals.busy), retry_after)
        self.metrics.no_worker.inc()
        return self._no_worker(refusals.failures + refusals.busy)

    async def _try(self, attempt: Attempt, method: str, path: str, body: bytes | None,
                   refusals: Refusals, request_id: str | None = None,
                   read_timeout: float | None = None) -> Opened | GatewayError | None:
        """The worker's answer (unread), a 504, or None (recorded in `refusals`): try another worker."""
        failures = refusals.failures
        worker = attempt.worker
        headers = worker.request_headers(request_id)
        try:
            answer = await self.upstream.request(method, worker.url, path, body, headers, read_timeout)
        except ConnectFailed as e:
            attempt.close()
            attempt.failed("connect")
            failures.append(f"{worker.url}: {e}")
            return None
        except UpstreamTimeout as e:
            attempt.close()
            attempt.failed("timeout")
            if read_timeout is not None:  # no side effect: the next worker may answer
                failures.append(f"{worker.url}: {e}")
                return None
            return GatewayError(504, f"the worker {worker.url} did not answer within {self.config.request_timeout_secs} s",
                                "worker_timeout", type="timeout")
        except UpstreamError as e:
            attempt.close()
            attempt.failed("reset")
            failures.append(f"{worker.url}: {e}")
            return None
        except BaseException:  # cancelled (the client left): nothing is the worker's fault
            attempt.close()
            raise
        attempt.answered(answer.status_code)
        if answer.status_code in RETRY_STATUSES:
            failures.append(f"{worker.url}: {await _refused(attempt, answer)}")
            return None
        if answer.status_code == BUSY_STATUS:
            retry_after = dict(answer.headers).get(b"retry-after")
            refusals.add_busy(f"{worker.url}: {await _refused(attempt, answer)}", retry_after)
            return None
        return attempt, answer

    def _no_worker(self, failures: list[str]) -> GatewayError:
        if failures:
            return unavailable("no worker could take the request: " + "; ".join(failures))
        if not self.registry.all():
            return unavailable("no worker is registered (add one with POST /workers)")
        return unavailable(f"no worker is available: {self.registry.states()}")


def _taken(outcome: Opened | GatewayError | None) -> bool:
    """Whether the worker took the request: it answered below 400, or it went silent on it (a 504:
    it may be working on it). None (no answer, a refusal to retry) and a 4xx / 5xx: it did not."""
    return isinstance(outcome, GatewayError) or (outcome is not None and outcome[1].status_code < 400)


async def _refused(attempt: Attempt, answer: Answer) -> str:
    """A refused answer as "status body-preview", read and closed, its attempt ended."""
    try:
        text = (await answer.read()).decode("utf-8", "replace")
    except UpstreamError:
        text = ""
    finally:
        answer.close()
        attempt.close()
    return f"{answer.status_code} {text[:_ERROR_BODY_PREVIEW]}"
