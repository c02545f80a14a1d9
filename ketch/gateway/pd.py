"""PD mode (`--pd-disaggregation`): each generation request goes to a prefill worker and a decode
worker at once; the decode worker fetches the prompt's KV from the prefill worker and its answer
is the client's (PRIOR_ART.md, "PD disaggregation": SGLang router's PD mode).

    pick a prefill worker (--policy over the prefill pool: cache-aware by default, since the
      prefix cache that matters lives where prompts are computed) and a decode worker (least load)
    the body + bootstrap_host (the prefill URL's host), bootstrap_port (its --prefill port),
      bootstrap_room (random, < 2^63: the pair's name for this transfer) ─▶ both, at once
    race until the decode answer has begun (status, headers and its first body bytes, or its end):
      prefill answers >= 400          ─▶ the decode request is closed (the decode server aborts);
                                         the client gets the prefill's answer as it is
                                         (and, as every prefill refusal, the prompt leaves the
                                         policy's tree: cache_aware's unlearn)
      prefill unreachable / lost      ─▶ the decode request is closed; 503 (504 if it timed out)
      decode unreachable / lost       ─▶ the prefill request is closed; 503 (504 if it timed out)
    then the decode answer is relayed (x-ketch-worker: decode, x-ketch-prefill-worker: prefill);
    the prefill's answer is read and dropped, in the background once the client has its answer

Why the race ends when the decode body begins, not at its headers: a decode stream's headers come
at once, its first token only once the KV arrived; until then the client has nothing, so a
prefill error can still be the client's answer instead of a stream that would stall and fail.

Not here, on purpose:
- Retries: once both workers were sent the request under one room, sending it again means a new
  pair and a new room; a pair that failed is answered at once (503 / 504) and charged.
- Mid-stream failover: resuming a stream on another decode worker would need the prompt's KV
  again, i.e. a new prefill for the prompt plus what was generated; a cut decode stream ends with
  the `worker_lost` error event, as with --disable-failover.

The client leaving closes both requests (the watcher in generate.py cancels this; the `finally`
cancels both legs, whose own cleanup closes their sockets), so both servers abort.
"""
from __future__ import annotations

import asyncio
import json
import random
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from starlette.responses import Response

from ketch.gateway.attempt import Attempt
from ketch.gateway.body import Receive
from ketch.gateway.errors import GatewayError, unavailable
from ketch.gateway.failover import NoFailover
from ketch.gateway.forward import Forwarder
from ketch.gateway.metrics import GatewayMetrics
from ketch.gateway.policies import Choice, LeastLoad, RoutingPolicy
from ketch.gateway.registry import WorkerRegistry
from ketch.gateway.relay import Send, relay, whole_response
from ketch.gateway.routed import RoutedRequest
from ketch.gateway.upstream import Answer, ConnectFailed, Upstream, UpstreamError, UpstreamTimeout
from ketch.gateway.worker import Worker

PREFILL_HEADER = b"x-ketch-prefill-worker"
ROOM_BITS = 63  # bootstrap_room: 0 <= room < 2^63 (a signed 64-bit integer on every side)

# what the prefill leg ends with: None (its answer came whole, and was dropped), or the client's answer
PrefillOutcome = GatewayError | Response | None


def with_bootstrap(body: bytes, prefill: Worker, room: int) -> bytes:
    """The request body both workers get: the client's fields plus the three bootstrap ones (the
    gateway's own: a client's values for them are replaced)."""
    fields = json.loads(body)  # parsed once more: the routed body is bytes, and this is one per request
    assert prefill.bootstrap_port is not None  # every prefill worker has one (config.PrefillWorker)
    fields.update(bootstrap_host=urlsplit(prefill.url).hostname, bootstrap_port=prefill.bootstrap_port,
                  bootstrap_room=room)
    return json.dumps(fields).encode()


class PDForwarder:
    """Generation requests to a (prefill, decode) pair; GET /v1/models through `plain` (a decode
    worker: the model the client talks to)."""

    def __init__(self, forwarder: Forwarder, upstream: Upstream, registry: WorkerRegistry, policy: RoutingPolicy,
                 metrics: GatewayMetrics, clock: Callable[[], float], rng: random.Random | None = None) -> None:
        self.plain = forwarder.plain  # its role is "decode"
        self.upstream, self.registry, self.policy, self.metrics, self.clock = upstream, registry, policy, metrics, clock
        self.decode_policy = LeastLoad()
        registry.on_removed.append(self.decode_policy.forget)
        self.timeout = forwarder.config.request_timeout_secs
        self.rng = rng or random.Random()
        self.failover = NoFailover()
        self._draining: set[asyncio.Task] = set()  # prefill answers read after the client got its own

    async def respond(self, request: RoutedRequest, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        pair = self._pair(request)
        if isinstance(pair, GatewayError):
            await pair.response()(scope, receive, send)
            return
        p_choice, decode = pair
        prefill = p_choice.worker
        body = with_bootstrap(request.body, prefill, self.rng.getrandbits(ROOM_BITS))
        p_attempt = Attempt(prefill, request.route, self.metrics, self.clock)
        d_attempt = Attempt(decode, request.route, self.metrics, self.clock)
        p_task = asyncio.create_task(self._prefill(p_attempt, request.path, body, request.request_id,
                                                   p_choice.unlearn))
        d_task = asyncio.create_task(self._decode(d_attempt, request.path, body, request.request_id))
        extra = [(PREFILL_HEADER, prefill.url.encode())]
        keep_prefill = False
        try:
            await asyncio.wait((p_task, d_task), return_when=asyncio.FIRST_COMPLETED)
            failed = p_task.result() if p_task.done() else None
            if failed is not None:  # before the decode answer began: the prefill's failure is the answer
                d_task.cancel()
                await _answer(failed, extra, scope, receive, send)
                return
            opened = await d_task
            if isinstance(opened, GatewayError):
                await opened.response()(scope, receive, send)
                return
            whole = await relay(send, d_attempt, opened, request, self.failover, extra)
            # the decode worker answered whole: the prefill's answer is bookkeeping, read to its end
            # so its server finishes the request normally; otherwise its request is closed
            keep_prefill = whole and opened.status_code < 400 and not p_task.done()
        finally:
            d_task.cancel()
            if d_task.done() and not d_task.cancelled() and d_task.exception() is None:
                decoded = d_task.result()
                if isinstance(decoded, Answer):  # not relayed (the prefill failed first): the decode server aborts
                    decoded.close()  # (a relayed one is closed already: this does nothing)
            d_attempt.close()
            if keep_prefill:
                self._draining.add(p_task)
                p_task.add_done_callback(self._draining.discard)
            else:
                p_task.cancel()

    def _pair(self, request: RoutedRequest) -> tuple[Choice, Worker] | GatewayError:
        """The prefill worker's choice (its `unlearn` is the prefill leg's to call) and the decode worker."""
        prefills = self.registry.available(role="prefill")
        decodes = self.registry.available(role="decode")
        if not prefills or not decodes:
            self.metrics.no_worker.inc()
            missing = " and ".join(role for role, ws in (("prefill", prefills), ("decode", decodes)) if not ws)
            return unavailable(f"no {missing} worker is available")
        p_choice = self.policy.pick(request, prefills)
        self.metrics.routed(self.policy.name, p_choice)
        d_choice = self.decode_policy.pick(request, decodes)
        self.metrics.routed(self.decode_policy.name, d_choice)
        return p_choice, d_choice.worker

    async def _open(self, attempt: Attempt, path: str, body: bytes, request_id: str | None) -> Answer | GatewayError:
        """The worker's answer (status and headers read), else the error, charged to the worker."""
        worker = attempt.worker
        headers = worker.request_headers(request_id)  # both workers of the pair: the client's request id
        try:
            answer = await self.upstream.request("POST", worker.url, path, body, headers)
        except UpstreamTimeout:
            attempt.failed("timeout")
            return GatewayError(504, f"the {worker.role} worker {worker.url} did not answer within {self.timeout:g} s",
                                "worker_timeout", type="timeout")
        except UpstreamError as e:
            attempt.failed("connect" if isinstance(e, ConnectFailed) else "reset")
            return unavailable(f"the {worker.role} worker {worker.url} could not take the request: {e}")
        attempt.answered(answer.status_code)
        return answer

    async def _decode(self, attempt: Attempt, path: str, body: bytes, request_id: str | None) -> Answer | GatewayError:
        """The decode worker's answer once its body began (or ended); cancelled, the socket closes."""
        opened = await self._open(attempt, path, body, request_id)
        if isinstance(opened, GatewayError):
            return opened
        try:
            await opened.began()
        except BaseException:
            opened.close()
            raise
        return opened

    async def _prefill(self, attempt: Attempt, path: str, body: bytes, request_id: str | None,
                       unlearn: Callable[[], object] | None = None) -> PrefillOutcome:
        """The prefill leg, whole: None once its answer was read to its end (and dropped); else
        what the client gets if the decode answer has not begun yet (relayed >= 400, or 503/504).
        `unlearn` (the policy's, cache_aware's tree) runs where the worker did not take the prompt,
        as in Forwarder._forward: it refused it (>= 400) or no connection carried it; a timeout or
        an answer cut midway leave it learnt (the worker may have computed the prefix)."""
        try:
            opened = await self._open(attempt, path, body, request_id)
            if isinstance(opened, GatewayError):
                if opened.status != 504 and unlearn is not None:
                    unlearn()
                return opened
            try:
                if opened.status_code >= 400:
                    if unlearn is not None:
                        unlearn()
                    return whole_response(opened, attempt, await opened.read())
                async for _ in opened.chunks():
                    pass
                return None
            except UpstreamError as e:
                attempt.failed("timeout" if isinstance(e, UpstreamTimeout) else "stream_cut")
                return unavailable(f"the prefill worker {attempt.worker.url} was lost while answering: {e}",
                                   "worker_lost")
            finally:
                opened.close()
        finally:
            attempt.close()

    async def stop(self) -> None:
        """Prefill answers still being read when the gateway stops: closed."""
        for task in list(self._draining):
            task.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)


async def _answer(outcome: GatewayError | Response, extra: Sequence[tuple[bytes, bytes]], scope: dict[str, Any],
                  receive: Receive, send: Send) -> None:
    response = outcome.response() if isinstance(outcome, GatewayError) else outcome
    response.raw_headers = [*response.raw_headers, *extra]
    await response(scope, receive, send)
