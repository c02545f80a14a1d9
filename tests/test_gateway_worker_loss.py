"""Worker losses as a gateway user meets them, injected for real on three `ketch serve` replicas:
the engine process of the worker serving a stream SIGKILLed (its API process reports it in the
stream, then exits), then the engine of the worker it went on on too, a worker SIGTERMed with a
short shutdown deadline mid-stream, then every worker gone, /health saying why.

The tests run in file order: each one's dead workers are the next one's starting point.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest
from gateway_util import (MODEL, Replica, replicas, request, running_gateway, sigkill_replica, start_replica,
                          stop, wait_healthy, workers)
from server_util import metrics, parse_metrics, wait_for
from test_gateway_faults import stream_events

from ketch.gateway.sse import event, worker_gone_at

BODY = {"model": MODEL, "prompt": "Count:", "max_tokens": 120, "ignore_eos": True, "temperature": 0,
        "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def cluster():
    with replicas(3) as rs:
        with running_gateway("--worker-urls", *(r.url for r in rs), "--policy", "round_robin",
                             "--health-check-interval-secs", "0.3", "--health-failure-threshold", "2",
                             "--health-success-threshold", "1") as (_, base):
            yield base, rs


def sigkill_engine(replica: Replica) -> None:
    """SIGKILL the replica's engine process only (as an out-of-memory kill would): its API process
    lives on long enough to tell its streams, in an `engine_unavailable` error event."""
    pid = replica.proc.pid
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    assert children, "the replica has no engine process"
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(child), signal.SIGKILL)


def test_a_stream_whose_workers_engine_dies_goes_on_on_the_survivor(cluster):
    """Without the fix the client got the worker's `engine_unavailable` error event and [DONE]
    (relayed as a whole stream: no failover, nothing charged), though the other worker could go on."""
    base, rs = cluster
    victims = []

    def kill_its_engine(resp) -> None:
        victims.append(next(r for r in rs if r.url == resp.getheader("x-ketch-worker")))
        sigkill_engine(victims[0])

    events = stream_events(base, BODY, kill_its_engine)
    assert_one_whole_stream(events, stream_events(next(r.url for r in rs if r is not victims[0]), BODY))
    m = gateway_metrics(base)
    assert m['ketch_gateway_failovers_total{outcome="resumed"}'] == 1
    assert m[f'ketch_gateway_worker_errors_total{{kind="stream_cut",worker="{victims[0].url}"}}'] == 1
    victims[0].proc.wait(timeout=60)  # its API process goes once its engine is gone


def assert_one_whole_stream(events: list[dict], reference: list[dict]) -> None:
    assert all("error" not in e for e in events), [e for e in events if "error" in e]
    assert {e["id"] for e in events} == {events[0]["id"]}
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == "".join(c["text"] for e in reference for c in e["choices"])
    assert events[-1]["usage"]["completion_tokens"] == BODY["max_tokens"]


def gateway_metrics(base: str) -> dict[str, float]:
    return parse_metrics(request(base, "GET", "/metrics")[2].decode())


def busy(replica: Replica) -> bool:
    m = metrics(replica.url)
    return m["ketch_num_requests_running"] + m["ketch_num_requests_waiting"] > 0


def test_a_stream_goes_on_past_the_engine_of_its_continuation_dying_too(cluster):
    """Without the fix the continuation's `engine_unavailable` event reached the client, its
    [DONE] counted as the stream resumed."""
    base, rs = cluster
    i = next(i for i, r in enumerate(rs) if r.proc.poll() is not None)  # the first test's dead worker
    rs[i] = start_replica(rs[i].port)  # back on its port (the fixture stops it)
    wait_healthy(rs[i])
    wait_for(lambda: workers(base)[rs[i].url]["available"], "the gateway to use it again", 20)
    victims: list[Replica] = []

    def kill_two_engines(resp) -> None:
        victims.append(next(r for r in rs if r.url == resp.getheader("x-ketch-worker")))
        sigkill_engine(victims[0])
        others = [r for r in rs if r is not victims[0]]
        wait_for(lambda: any(busy(r) for r in others), "the stream to go on on another worker", 30)
        victims.append(next(r for r in others if busy(r)))
        sigkill_engine(victims[1])

    before = gateway_metrics(base)
    events = stream_events(base, BODY, kill_two_engines)
    last = next(r for r in rs if r not in victims)
    assert_one_whole_stream(events, stream_events(last.url, BODY))
    m = gateway_metrics(base)
    resumed = 'ketch_gateway_failovers_total{outcome="resumed"}'
    assert m[resumed] == before[resumed] + 1
    cut = f'ketch_gateway_worker_errors_total{{kind="stream_cut",worker="{victims[1].url}"}}'
    assert m[cut] == before.get(cut, 0) + 1
    for v in victims:
        v.proc.wait(timeout=60)


def test_only_a_workers_own_going_event_marks_it_gone():
    lost = event({"error": {"message": "the engine process exited (code -9)", "type": "service_unavailable",
                            "param": None, "code": "engine_unavailable"}})
    text = event({"choices": [{"index": 0, "text": '{"code": "engine_unavailable"}'}]})
    assert worker_gone_at(text) == -1 and worker_gone_at(text + text) == -1
    assert worker_gone_at(lost) == 0 and worker_gone_at(text + lost + b"data: [DONE]\n\n") == len(text)
    shutdown = event({"error": {"message": "the server is shutting down; the request was cut at the shutdown deadline",
                                "type": "service_unavailable", "param": None, "code": "server_shutdown"}})
    assert worker_gone_at(text + shutdown) == len(text)
    bad = event({"error": {"message": "prompt: too long", "type": "invalid_request_error", "param": None,
                           "code": "context_length_exceeded"}})
    assert worker_gone_at(bad) == -1 and worker_gone_at(bad + lost) == len(bad)


def test_a_stream_cut_by_its_workers_shutdown_deadline_goes_on_elsewhere(cluster):
    """A worker SIGTERMed (a rolling restart) ends what is still running at its --shutdown-timeout
    with a `server_shutdown` error event: without the fix the client got it, though another
    worker could go on. Every worker is restarted first with a short deadline."""
    base, rs = cluster
    for r in rs:
        if r.proc.poll() is None:
            stop(r.proc)
    rs[:] = [start_replica(r.port, "--shutdown-timeout", "0.5") for r in rs]  # the fixture stops them
    for r in rs:
        wait_healthy(r)
    wait_for(lambda: all(w["available"] for w in workers(base).values()), "the gateway to use them again", 20)
    victims: list[Replica] = []

    def sigterm_its_worker(resp) -> None:
        victims.append(next(r for r in rs if r.url == resp.getheader("x-ketch-worker")))
        victims[0].proc.send_signal(signal.SIGTERM)

    before = gateway_metrics(base)
    events = stream_events(base, BODY, sigterm_its_worker)
    victims[0].proc.wait(timeout=60)
    assert_one_whole_stream(events, stream_events(next(r.url for r in rs if r is not victims[0]), BODY))
    resumed = 'ketch_gateway_failovers_total{outcome="resumed"}'
    assert gateway_metrics(base)[resumed] == before[resumed] + 1


def test_with_every_worker_down_health_says_why(cluster):
    """Without the fix /health said only "no worker is available (2 registered)"."""
    base, rs = cluster
    for r in rs:
        if r.proc.poll() is None:
            sigkill_replica(r)
    wait_for(lambda: request(base, "GET", "/health")[0] == 503, "the health checks to fail every worker", 20)
    status, headers, answer = request(base, "GET", "/health")
    assert status == 503 and headers["content-type"] == "application/json"
    assert request(base, "HEAD", "/health")[:3:2] == (503, b"")
    error = json.loads(answer)["error"]
    assert error["code"] == "no_available_workers"
    for r in rs:  # each worker, its state, and what its last health check met
        assert f"{r.url} (unhealthy, breaker closed: ConnectError" in error["message"], error["message"]
    status, _, answer = request(base, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert status == 503 and "ConnectError" in json.loads(answer)["error"]["message"]
