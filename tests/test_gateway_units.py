"""The gateway's small parts without servers: circuit breaker, health tracker, worker URLs,
routed text, retry backoff, SSE event boundaries, the /metrics scrape parser, config checks."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from ketch.gateway.attempt import Attempt
from ketch.gateway.breaker import BreakerState, CircuitBreaker
from ketch.gateway.config import BreakerConfig, CacheAwareConfig, GatewayConfig, HealthConfig, RetryConfig
from ketch.gateway.failover import StreamTranscript
from ketch.gateway.forward import backoff_seconds
from ketch.gateway.generate import Generation
from ketch.gateway.metrics import GatewayMetrics
from ketch.gateway.monitor import queue_length
from ketch.gateway.policies import make_policy
from ketch.gateway.registry import WorkerRegistry
from ketch.gateway.sse import event_boundary, lost_event
from ketch.gateway.routed import CHAT, COMPLETIONS, chat_text, routed_request
from ketch.gateway.worker import HealthTracker
from ketch.gateway.worker_url import parse_worker_url


def test_breaker_opens_after_consecutive_failures_only():
    b = CircuitBreaker(BreakerConfig(failure_threshold=3, success_threshold=2, timeout_duration_secs=10))
    for _ in range(2):
        b.record_failure(0)
    b.record_success(0)  # a success in between: the count starts over
    for _ in range(2):
        b.record_failure(0)
    assert b.state(0) is BreakerState.CLOSED and b.allows(0)
    b.record_failure(1)
    assert b.state(1) is BreakerState.OPEN and not b.allows(1) and b.times_opened == 1
    assert not b.allows(10.9)  # still cooling down


def test_breaker_half_open_lets_one_probe_at_a_time_and_closes_after_successes():
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, success_threshold=2, timeout_duration_secs=10))
    b.record_failure(0)
    assert b.state(10) is BreakerState.HALF_OPEN and b.allows(10)
    b.dispatched(10)
    assert not b.allows(10)  # the probe is out: nothing else until it reports
    b.record_success(11)
    assert b.state(11) is BreakerState.HALF_OPEN and b.allows(11)  # one success of two
    b.dispatched(11)
    b.record_success(12)
    assert b.state(12) is BreakerState.CLOSED and b.allows(12) and b.times_opened == 1


def test_a_probe_that_ends_without_an_outcome_gives_its_slot_back():
    """The half-open probe's client left before the worker answered (the gateway cancels the
    attempt): nothing is known, and the next request must be let through to probe, or the worker
    stays shut out (it did, until a gateway restart). A request that was not the probe, closed the
    same way, leaves the probe's slot alone."""
    cfg = BreakerConfig(failure_threshold=1, success_threshold=1, timeout_duration_secs=10)
    registry = WorkerRegistry(cfg, HealthConfig())
    worker = registry.add(parse_worker_url("http://127.0.0.1:1"))
    clock = [0.0]
    metrics = GatewayMetrics(registry, make_policy("round_robin", CacheAwareConfig()), lambda: clock[0])
    before = Attempt(worker, "/v1/completions", metrics, lambda: clock[0])  # sent while closed
    worker.breaker.record_failure(0)
    clock[0] = 10.0
    probe = Attempt(worker, "/v1/completions", metrics, lambda: clock[0])
    assert not worker.breaker.allows(10)  # the probe is out
    before.close()  # the older request's client left: not the probe
    assert not worker.breaker.allows(10)
    probe.close()  # cancelled: no answer, no failure
    assert worker.breaker.state(10) is BreakerState.HALF_OPEN and worker.breaker.allows(10)
    answered = Attempt(worker, "/v1/completions", metrics, lambda: clock[0])
    answered.answered(200)
    answered.close()
    assert worker.breaker.state(10) is BreakerState.CLOSED and worker.in_flight == 0


def test_breaker_half_open_failure_reopens_for_a_full_cool_down():
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, success_threshold=1, timeout_duration_secs=10))
    b.record_failure(0)
    b.dispatched(10)
    b.record_failure(10)
    assert b.state(19) is BreakerState.OPEN and b.times_opened == 2
    assert b.state(20) is BreakerState.HALF_OPEN


def test_breaker_ignores_late_outcomes_while_open_and_can_be_disabled():
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, timeout_duration_secs=10))
    b.record_failure(0)
    b.record_success(1)  # a request sent before it opened: does not close it
    assert b.state(1) is BreakerState.OPEN
    off = CircuitBreaker(BreakerConfig(failure_threshold=1, enabled=False))
    off.record_failure(0)
    assert off.allows(0)


def test_health_tracker_thresholds():
    h = HealthTracker(HealthConfig(failure_threshold=2, success_threshold=2))
    h.record(False, "refused")
    assert h.healthy and h.last_error == "refused"
    h.record(False, "refused")
    assert not h.healthy
    h.record(True)
    assert not h.healthy
    h.record(True)
    assert h.healthy and h.last_error is None


@pytest.mark.parametrize("text, url, key", [
    ("http://127.0.0.1:30001", "http://127.0.0.1:30001", None),
    (" HTTP://Worker.Example:8000/ ", "http://worker.example:8000", None),
    ("https://w", "https://w", None),
    ("http://:s3cret@127.0.0.1:1", "http://127.0.0.1:1", "s3cret"),
    ("http://:a%2Fb%40c@h:2", "http://h:2", "a/b@c"),
    ("http://[::1]:30000", "http://[::1]:30000", None),
])
def test_worker_urls_are_canonical_and_keep_keys_out(text: str, url: str, key: str | None):
    address = parse_worker_url(text)
    assert (address.url, address.api_key) == (url, key)


@pytest.mark.parametrize("text, why", [
    ("", "non-empty"), (None, "non-empty"), (42, "non-empty"), ("127.0.0.1:30000", "scheme"),
    ("ftp://h:1", "scheme"), ("http://", "no host"), ("http://h:99999", "Port"), ("http://h:x", "Port"), ("http://h:0", "Port"),
    ("http://h:1/v1", "no path"), ("http://h:1?a=b", "no path"), ("http://user@h:1", "password"),
])
def test_bad_worker_urls_say_what_is_wrong(text, why: str):
    with pytest.raises(ValueError, match=why):
        parse_worker_url(text)


def test_chat_text_of_a_longer_conversation_extends_the_shorter_one():
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": [
        {"type": "text", "text": "how "}, {"type": "image_url", "image_url": {}}, {"type": "text", "text": "are you"}]}]
    a, b = chat_text({"messages": turn1}), chat_text({"messages": turn2})
    assert b.startswith(a) and len(b) > len(a) and "how are you" in b
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = chat_text({"messages": turn1, "tools": tools})
    assert with_tools.endswith(a) and with_tools.startswith(json.dumps(tools, sort_keys=True))


@pytest.mark.parametrize("body, text", [
    ({"prompt": "abc"}, "abc"), ({"prompt": ["first", "second"]}, "first"), ({"prompt": [1, 22, 3]}, "1 22 3"),
    ({"prompt": [[5, 6], [7]]}, "5 6"), ({"prompt": 3}, ""), ({}, ""), ({"prompt": []}, ""),
])
def test_completions_text(body: dict, text: str):
    assert routed_request(COMPLETIONS, b"", body).text == text


def test_malformed_chat_bodies_route_without_raising():
    for body in ({"messages": "hi"}, {"messages": [1, None, {"content": 3}]}, {"messages": None}, {"tools": 5}):
        routed = routed_request(CHAT, b"", body)
        assert isinstance(routed.text, str) and routed.stream is False
    assert routed_request(CHAT, b"", {"stream": True}).stream and not routed_request(CHAT, b"", {"stream": 1}).stream


def test_backoff_grows_caps_and_jitters_within_bounds():
    rng = random.Random(0)
    plain = [backoff_seconds(k, 50, 300, 2.0, 0.0, rng) for k in range(1, 6)]
    assert plain == [0.05, 0.1, 0.2, 0.3, 0.3]
    jittered = [backoff_seconds(1, 100, 5000, 2.0, 0.1, rng) for _ in range(200)]
    assert all(0.09 <= s <= 0.11 for s in jittered) and len(set(jittered)) > 100


def test_event_boundary_and_transcript():
    assert event_boundary(b"data: {}\n\ndata: {") == len(b"data: {}\n\n")
    assert event_boundary(b"data: {}\r\n\r\n") == len(b"data: {}\r\n\r\n")
    assert event_boundary(b"data: {\"a\": 1}\n") == 0
    t = StreamTranscript()
    t.feed(b"data: {}\n\ndata: {}\n\n")
    assert (t.events, t.done, t.blocks) == (2, False, [])  # events are kept only for a failover that wants them
    t.feed(b"data: [DONE]\n\n")
    assert t.events == 3 and t.done
    lost = lost_event("http://w:1", "reset")
    assert lost.endswith(b"\n\ndata: [DONE]\n\n")
    assert json.loads(lost.split(b"\n\n")[0][len(b"data: "):])["error"]["code"] == "worker_lost"


def test_queue_length_from_a_workers_metrics():
    text = (b"# HELP ketch_num_requests_running x\nketch_num_requests_running 3.0\n"
            b"ketch_num_requests_running_other 100\nketch_num_requests_waiting 4.0\n")
    assert queue_length(text) == 7
    with pytest.raises(ValueError, match="ketch_num_requests_waiting"):
        queue_length(b"ketch_num_requests_running 1\n")


@pytest.mark.parametrize("kwargs, field", [
    ({"policy": "random"}, "policy"), ({"port": 70000}, "port"), ({"load_interval_secs": 0}, "load_interval_secs"),
    ({"request_timeout_secs": float("inf")}, "request_timeout_secs"), ({"max_request_bytes": 0}, "max_request_bytes"),
])
def test_config_names_the_bad_field(kwargs: dict, field: str):
    with pytest.raises(ValueError, match=field):
        GatewayConfig(**kwargs)
    with pytest.raises(ValueError, match="retry_max_retries"):
        RetryConfig(max_retries=0)
    with pytest.raises(ValueError, match="cb_failure_threshold"):
        BreakerConfig(failure_threshold=0)
    assert RetryConfig(max_retries=4, enabled=False).attempts == 1


@pytest.mark.parametrize("argv, message", [
    (["--worker-urls", "ftp://127.0.0.1:1"], "scheme must be http"),
    (["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:1/"], "already registered"),
    (["--cache-threshold", "1.5"], "cache_threshold"),
    (["--cb-failure-threshold", "0"], "cb_failure_threshold"),
])
def test_the_cli_refuses_bad_flags_before_serving(argv: list[str], message: str, capsys: pytest.CaptureFixture):
    from ketch.cli import main

    assert main(["gateway", "--port", "0", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_request_whose_body_completes_after_the_shutdown_deadline_gets_a_503():
    """Past the deadline (`cut_open`) nothing is forwarded any more: the answer is a 503
    `server_shutdown`, not a request that uvicorn's own deadline would cut a moment later."""
    class NoWorker:
        async def respond(self, *args) -> None:
            raise AssertionError("forwarded after the shutdown deadline")

    generation = Generation(lambda: NoWorker(), max_request_bytes=1 << 20)
    generation.cut_open()
    body = json.dumps({"model": "m", "prompt": "Hi", "stream": True}).encode()
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(generation({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
                           receive, send, COMPLETIONS))
    assert sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"] == "server_shutdown"
