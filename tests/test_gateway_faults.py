"""Faults injected for real behind `ketch gateway`: a worker URL where nothing listens, replicas
SIGKILLed (one mid-stream), every worker gone, and a worker coming back on the dead port.

Two gateways watch the same workers [dead port, A, B]:
- `base`: circuit breakers only (2 failures open one, 3 s cool-down, 1 good probe closes it);
  its health checks run once at start, so whatever it skips, the breaker skipped;
- `health_base`: health checks only (every 0.3 s, 2 failures / 1 success), breakers disabled.
The tests run in file order: each one's faults are the next one's starting point.
"""
from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass

import openai
import pytest
from gateway_util import (MODEL, Replica, replicas, request, running_gateway, sigkill_replica, start_replica, stop,
                          wait_healthy, workers)
from server_util import connect, free_port, parse_metrics, wait_for

COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}


@dataclass
class Cluster:
    base: str
    health_base: str
    replicas: list[Replica]
    dead_port: int

    @property
    def dead_url(self) -> str:
        return f"http://127.0.0.1:{self.dead_port}"


@pytest.fixture(scope="module")
def cluster():
    dead_port = free_port()
    with replicas(2) as rs:
        urls = [f"http://127.0.0.1:{dead_port}", *(r.url for r in rs)]
        # the breaker stays open 15 s: the first test reads it open after a dozen CPU completions
        with running_gateway("--worker-urls", *urls, "--policy", "round_robin", "--cb-failure-threshold", "2",
                             "--cb-success-threshold", "1", "--cb-timeout-duration-secs", "15",
                             "--health-check-interval-secs", "600") as (_, base), \
             running_gateway("--worker-urls", *urls, "--policy", "round_robin", "--disable-circuit-breaker",
                             "--health-check-interval-secs", "0.3", "--health-failure-threshold", "2",
                             "--health-success-threshold", "1") as (_, health_base):
            yield Cluster(base, health_base, rs, dead_port)


def served_by(base: str) -> str:
    status, headers, body = request(base, "POST", "/v1/completions", COMPLETION)
    assert status == 200, body
    return headers["x-ketch-worker"]


def gateway_metrics(base: str) -> dict[str, float]:
    return parse_metrics(request(base, "GET", "/metrics")[2].decode())


def errors(m: dict[str, float], url: str, kind: str) -> float:
    return m.get(f'ketch_gateway_worker_errors_total{{kind="{kind}",worker="{url}"}}', 0.0)


def test_a_hung_worker_holds_get_models_for_the_health_timeout_not_the_generation_one(cluster: Cluster):
    """A worker that takes connections and never answers (a stopped process: the kernel still
    completes the handshake) is first in line for GET /v1/models (equal loads, listed first, not
    yet failed by health checks): the gateway gives it the health check's timeout, then asks the
    next worker. Before, the read waited --request-timeout-secs (1800 s by default)."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)  # never accepted, never answered
        hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        live = cluster.replicas[0].url
        with running_gateway("--worker-urls", hung_url, live, "--health-check-interval-secs", "600",
                             "--health-check-timeout-secs", "1", "--request-timeout-secs", "120") as (_, base):
            assert workers(base)[hung_url]["available"]  # the one failed start-up check is not enough
            status, headers, body = request(base, "GET", "/v1/models", timeout=60)
            assert status == 200, body
            assert [m["id"] for m in json.loads(body)["data"]] == [MODEL]
            assert headers["x-ketch-worker"] == live
            assert errors(gateway_metrics(base), hung_url, "timeout") == 1  # it was asked first


def test_a_port_with_nothing_listening_is_skipped_and_its_breaker_opens(cluster: Cluster):
    live = {r.url for r in cluster.replicas}
    assert {served_by(cluster.base) for _ in range(6)} == live  # every request answered, none by the dead port
    state = workers(cluster.base)[cluster.dead_url]
    assert state["breaker"] == "open" and not state["available"] and state["healthy"]  # the breaker's doing
    m = gateway_metrics(cluster.base)
    assert errors(m, cluster.dead_url, "connect") == 2  # round robin met it twice, then it was open
    assert m["ketch_gateway_retries_total"] == 2
    assert m[f'ketch_gateway_worker_breaker_state{{worker="{cluster.dead_url}"}}'] == 1
    assert {served_by(cluster.base) for _ in range(6)} == live
    assert errors(gateway_metrics(cluster.base), cluster.dead_url, "connect") <= 3  # at most one half-open probe
    wait_for(lambda: not workers(cluster.health_base)[cluster.dead_url]["healthy"], "the health checks to fail it", 10)
    assert {served_by(cluster.health_base) for _ in range(4)} == live


def stream_events(base: str, body: dict, on_first_event=None) -> list[dict]:
    """A streamed completion's events ([DONE] checked and left out); `on_first_event(response)` is
    called once the first one arrived (the engine has the request)."""
    conn = connect(base, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        lines = [resp.readline()]
        if on_first_event is not None:
            on_first_event(resp)
        lines += list(resp)
    finally:
        conn.close()
    events = [line[6:].strip() for line in lines if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_stream_whose_worker_is_sigkilled_goes_on_on_the_survivor(cluster: Cluster):
    """The stream goes on on the other replica: one unbroken stream (one id, no error, no token_ids
    the client did not ask for) with the text of the same request on a healthy server."""
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 160, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    victims = []

    def kill_its_worker(resp) -> None:
        victims.append(resp.getheader("x-ketch-worker"))
        sigkill_replica(next(r for r in cluster.replicas if r.url == victims[0]))

    events = stream_events(cluster.base, body, kill_its_worker)
    survivor = next(r.url for r in cluster.replicas if r.url != victims[0])
    reference = stream_events(survivor, body)
    assert all("error" not in e and "token_ids" not in str(e) for e in events), events
    assert {e["id"] for e in events} == {events[0]["id"]}
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == "".join(c["text"] for e in reference for c in e["choices"])
    assert events[-1]["usage"] == reference[-1]["usage"] | {"prompt_tokens_details": events[-1]["usage"]["prompt_tokens_details"]}
    assert events[-1]["usage"]["completion_tokens"] == 160
    wait_for(lambda: workers(cluster.base)[victims[0]]["in_flight"] == 0, "the stream's slot to come back", 10)
    m = gateway_metrics(cluster.base)
    assert errors(m, victims[0], "stream_cut") == 1
    assert m['ketch_gateway_failovers_total{outcome="resumed"}'] == 1


def test_requests_after_a_sigkill_go_to_the_survivor(cluster: Cluster):
    victim = next(r.url for r in cluster.replicas if r.proc.poll() is not None)
    survivor = next(r.url for r in cluster.replicas if r.proc.poll() is None)
    assert {served_by(cluster.base) for _ in range(6)} == {survivor}
    assert workers(cluster.base)[victim]["breaker"] == "open"
    wait_for(lambda: not workers(cluster.health_base)[victim]["healthy"], "the health checks to fail the victim", 10)
    before = errors(gateway_metrics(cluster.health_base), victim, "connect")
    assert {served_by(cluster.health_base) for _ in range(4)} == {survivor}
    assert errors(gateway_metrics(cluster.health_base), victim, "connect") == before  # not even tried


def test_with_every_worker_down_answers_are_503s_at_once(cluster: Cluster):
    sigkill_replica(next(r for r in cluster.replicas if r.proc.poll() is None))
    for base in (cluster.base, cluster.health_base):
        for body in (COMPLETION, {**COMPLETION, "stream": True}):
            for _ in range(3):
                started = time.monotonic()
                status, headers, answer = request(base, "POST", "/v1/completions", body)
                # refused connections and open breakers: no waiting (a connect timeout is 5 s)
                assert time.monotonic() - started < 4.0
                assert status == 503 and headers["content-type"] == "application/json"
                assert json.loads(answer)["error"]["code"] == "no_available_workers"
    assert request(cluster.base, "GET", "/health")[0] == 503
    wait_for(lambda: request(cluster.health_base, "GET", "/health")[0] == 503, "the health gateway to see it", 10)
    with pytest.raises(openai.InternalServerError, match="no worker"):
        openai.OpenAI(base_url=f"{cluster.base}/v1", api_key="x", max_retries=0).models.list()


def test_a_worker_coming_back_on_the_dead_port_is_used_again(cluster: Cluster):
    """The router that panicked when every worker died and came back (PRIOR_ART.md, known
    failure 10): here the first URL, dead from the start, comes alive."""
    revived = start_replica(cluster.dead_port)
    try:
        wait_healthy(revived)
        for base in (cluster.base, cluster.health_base):  # a half-open probe, a passed health check
            wait_for(lambda: request(base, "POST", "/v1/completions", COMPLETION)[0] == 200,
                     "the gateway to use the revived worker", 30)
            assert served_by(base) == cluster.dead_url
        assert workers(cluster.base)[cluster.dead_url]["breaker"] == "closed"
        assert request(cluster.base, "GET", "/health")[0] == 200
    finally:
        stop(revived.proc)
