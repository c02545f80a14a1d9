"""Send a request to a worker the policy picks; when it reaches none, try another.

    attempt 1..N (N = --retry-max-retries), each to a worker not tried yet, backoff in between:
      no worker left to try           ─▶ 503 no_available_workers (at once: never waits for one)
      connect refused / lost before   ─▶ charged to the worker, next attempt
        an answer / 502 / 503
      silent past the timeout         ─▶ charged to the worker, 504 (it may still be working:
                                         the request is not sent twice)
      any other answer                ─▶ relayed as it is (status, headers, body), 4xx and 5xx too

Why those retry: a refused connection or a 502/503 (the worker shutting down, its engine gone)
means the worker did not take the request, so another may; a reset before any answer means it
died with it, and a generation has no side effect worth protecting. Once the client has a byte
of the answer nothing is retried here: a stream whose worker is lost goes on elsewhere from what the
client has (failover.py, through `continuation`).
"""
from __future__ import annotations

import asyncio
import random
from typing import Any, Awaitable, Callable, Collection, Sequence

import anyio
import httpx2 as httpx
from starlette.responses import Response

from ketch.gateway.attempt import Attempt
from ketch.gateway.config import GatewayConfig
from ketch.gateway.errors import GatewayError, unavailable
from ketch.gateway.failover import Failover
from ketch.gateway.metrics import GatewayMetrics
from ketch.gateway.policies import RoutingPolicy
from ketch.gateway.registry import WorkerRegistry
from ketch.gateway.relay import Relay
from ketch.gateway.routed import RoutedRequest
from ketch.gateway.worker import Worker

RETRY_STATUSES = frozenset({502, 503})
CLIENT_GONE = 499  # what a request whose client left before any answer "gets" (nginx's code; nobody reads it)
_ERROR_BODY_PREVIEW = 300  # characters of a refused answer quoted in the final 503


def backoff_seconds(retry: int, initial_ms: float, max_ms: float, multiplier: float, jitter: float,
                    rng: random.Random) -> float:
    """Before the `retry`-th retry (1, 2, ...): initial × multiplier^(retry-1), capped, ± jitter."""
    base = min(max_ms, initial_ms * multiplier ** (retry - 1))
    return base * (1 + jitter * rng.uniform(-1.0, 1.0)) / 1000.0


class Forwarder:
    def __init__(self, client: httpx.AsyncClient, registry: WorkerRegistry, policy: RoutingPolicy,
                 metrics: GatewayMetrics, config: GatewayConfig, failover: Failover,
                 clock: Callable[[], float], rng: random.Random | None = None) -> None:
        self.client, self.registry, self.policy, self.metrics = client, registry, policy, metrics
        self.config, self.failover, self.clock = config, failover, clock
        self.rng = rng or random.Random()

    async def generation(self, request: RoutedRequest,
                         until_disconnect: Callable[[], Awaitable[None]] | None = None) -> Response:
        """`until_disconnect` returns when the client leaves: a request still waiting for a worker's
        answer (a whole, non-streamed generation takes a while) is then given up, and closing its
        connection makes the worker abort the generation instead of finishing it for nobody."""
        pick = self._picker(request)
        if until_disconnect is None:
            return await self._forward(pick, "POST", request.path, request.body, request)
        answer = Response(status_code=CLIENT_GONE)
        async with anyio.create_task_group() as tasks:
            async def watch() -> None:
                await until_disconnect()
                tasks.cancel_scope.cancel()

            tasks.start_soon(watch)
            answer = await self._forward(pick, "POST", request.path, request.body, request)
            tasks.cancel_scope.cancel()  # the relay watches for the disconnect from here on
        return answer

    async def continuation(self, request: RoutedRequest, body: bytes,
                           exclude: set[str]) -> tuple[Attempt, httpx.Response] | str:
        """A stream that goes on from a lost worker's (failover.py): `body` to a worker not in
        `exclude`, picked and retried as any request. Its 200 answer, still unread; or why not."""
        opened = await self._forward(self._picker(request), "POST", request.path, body, request,
                                     exclude=exclude, relay=False)
        if not isinstance(opened, tuple):  # no worker took it (503), or one timed out (504)
            return opened.body.decode("utf-8", "replace")
        attempt, upstream = opened
        if upstream.status_code == 200:
            return opened
        # refused (a 4xx: the resume request itself; a 500): not worth another worker
        return f"{attempt.worker.url} refused it: {await _refused(attempt, upstream)}"

    def _picker(self, request: RoutedRequest) -> Callable[[Sequence[Worker]], Worker]:
        def pick(workers: Sequence[Worker]) -> Worker:
            choice = self.policy.pick(request, workers)
            self.metrics.routed(self.policy.name, choice)
            return choice.worker
        return pick

    async def plain(self, method: str, path: str) -> Response:
        """A request with nothing to route by (GET /v1/models): the least loaded worker, policy
        state untouched."""
        return await self._forward(lambda ws: min(ws, key=lambda w: w.load), method, path, None, None)

    async def _forward(self, pick: Callable[[Sequence[Worker]], Worker], method: str, path: str,
                       body: bytes | None, routed: RoutedRequest | None, exclude: Collection[str] = (),
                       relay: bool = True) -> Any:
        """The relayed answer (or, `relay` False, the attempt and its unread answer), else the error."""
        tried: set[str] = set(exclude)
        failures: list[str] = []
        retry = self.config.retry
        route = routed.route if routed is not None else path
        for attempt_no in range(retry.attempts):
            workers = self.registry.available(exclude=tried)
            if not workers:
                break
            if attempt_no:
                self.metrics.retries.inc()
                await asyncio.sleep(backoff_seconds(attempt_no, retry.initial_backoff_ms, retry.max_backoff_ms,
                                                    retry.backoff_multiplier, retry.jitter_factor, self.rng))
                # a worker may have left or failed meanwhile: pick among those still available
                workers = self.registry.available(exclude=tried)
                if not workers:
                    break
            worker = pick(workers)
            tried.add(worker.url)
            attempt = Attempt(worker, route, self.metrics, self.clock)
            outcome = await self._try(attempt, method, path, body, failures)
            if isinstance(outcome, httpx.Response):
                return Relay(outcome, attempt, routed, self.failover) if relay else (attempt, outcome)
            if outcome is not None:
                return outcome
        self.metrics.no_worker.inc()
        return self._no_worker(failures).response()

    async def _try(self, attempt: Attempt, method: str, path: str, body: bytes | None,
                   failures: list[str]) -> httpx.Response | Response | None:
        """The worker's answer (unread), a 504, or None (recorded in `failures`): try another worker."""
        worker = attempt.worker
        headers = {"content-type": "application/json", "accept-encoding": "identity", **worker.auth_headers()}
        request = self.client.build_request(method, worker.url + path, content=body, headers=headers)
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.TimeoutException as e:
            attempt.close()
            if isinstance(e, (httpx.ConnectTimeout, httpx.PoolTimeout)):
                attempt.failed("connect")
                failures.append(f"{worker.url}: connect timeout")
                return None
            attempt.failed("timeout")
            return GatewayError(504, f"the worker {worker.url} did not answer within {self.config.request_timeout_secs} s",
                                "worker_timeout", type="timeout").response()
        except httpx.TransportError as e:
            attempt.close()
            attempt.failed("connect" if isinstance(e, httpx.ConnectError) else "reset")
            failures.append(f"{worker.url}: {type(e).__name__}: {e}" if str(e) else f"{worker.url}: {type(e).__name__}")
            return None
        except BaseException:  # cancelled (the client left): nothing is the worker's fault
            attempt.close()
            raise
        attempt.answered(upstream.status_code)
        if upstream.status_code in RETRY_STATUSES:
            failures.append(f"{worker.url}: {await _refused(attempt, upstream)}")
            return None
        return upstream

    def _no_worker(self, failures: list[str]) -> GatewayError:
        if failures:
            return unavailable("no worker could take the request: " + "; ".join(failures))
        workers = self.registry.all()
        if not workers:
            return unavailable("no worker is registered (add one with POST /workers)")
        now = self.clock()
        states = ", ".join(f"{w.url} ({'healthy' if w.health.healthy else 'unhealthy'}, breaker "
                           f"{w.breaker.state(now).name.lower()})" for w in workers)
        return unavailable(f"no worker is available: {states}")


async def _refused(attempt: Attempt, upstream: httpx.Response) -> str:
    """A refused answer as "status body-preview", read and closed, its attempt ended."""
    try:
        text = (await upstream.aread()).decode("utf-8", "replace")
    except httpx.TransportError:
        text = ""
    finally:
        await upstream.aclose()
        attempt.close()
    return f"{upstream.status_code} {text[:_ERROR_BODY_PREVIEW]}"
