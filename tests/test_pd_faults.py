"""PD servers losing their peer, for real: `ketch serve` prefill and decode processes on loopback
(the bundled SmolLM2, CPU, tcp backend), SIGSTOPped and SIGKILLed by the test.

- a decode server killed mid-transfer: the prefill server's client gets an error, every page
  comes back within the timeout, and the prefill server goes on serving with another decode server;
- a prefill server killed mid-transfer: the same on the decode side;
- a bootstrap never answered (no decode server ever claims the room; a "prefill server" that
  accepts the connection and never speaks): the waiting side gives up within the timeout, frees
  its pages, and answers with an error.

"Mid-transfer" is made certain rather than hoped for: the decode server is SIGSTOPped once its
room is registered, so the prefill server's push stalls on the credits the decode side no longer
grants (the prompt's KV is several times the tcp window) and shows `transferring` in /metrics
until the test strikes. In the second case the stopped decode server is resumed after its peer's
death, with the first chunks of the KV already on its socket.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from gateway_util import Replica, sigkill_replica, start_replica, stop, wait_healthy
from pd_util import answer, call
from server_util import free_port, metrics, pages_all_back, wait_for

TIMEOUT_S = 15.0  # every server's --disaggregation-timeout
LONG = "hello " * 2000  # ~2,000 tokens: 92 MB of fp32 KV, about 3x tcp's 8 x 4 MiB window
SHORT = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
LIVE = 'ketch_pd_transfers{state="%s"}'
FAILED = 'ketch_pd_transfers_ended_total{outcome="failed"}'
_rooms = iter(range(5000, 6000))


@pytest.fixture(scope="module")
def servers():
    """Two prefill servers (with their bootstrap ports) and two decode servers: each kill test
    takes one pair and shows the survivor working with the spare of the other kind."""
    boots = [free_port(), free_port()]
    pd = ("--disaggregation-transfer-backend", "tcp", "--disaggregation-timeout", str(TIMEOUT_S))
    prefills = [start_replica(free_port(), "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                              str(b), *pd) for b in boots]
    decodes = [start_replica(free_port(), "--disaggregation-mode", "decode", *pd) for _ in range(2)]
    try:
        for r in prefills + decodes:
            wait_healthy(r)
        yield list(zip(prefills, boots)), decodes
    finally:
        for r in prefills + decodes:
            if r.proc.poll() is None:  # a failed test may leave one stopped
                _signal(r, signal.SIGCONT)
            stop(r.proc)


@pytest.fixture(scope="module")
def short_answer(servers) -> tuple:
    """What SHORT gets through a healthy pair, before any fault (the survivors must give the same)."""
    (p1, b1), _ = servers[0]
    return _pd(p1, b1, servers[1][1], SHORT)


def _signal(replica: Replica, sig: int) -> None:
    """`sig` to the server's API process and its engine process (which runs the transport)."""
    pid = replica.proc.pid
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    for p in [pid, *map(int, children)]:
        os.kill(p, sig)


def _start_pd(prefill: Replica, boot: int, decode: Replica, body: dict) -> tuple[Future, Future]:
    """The same body and room to both servers, as the PD gateway sends it."""
    pd_body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": next(_rooms)}
    pool = ThreadPoolExecutor(2)
    futures = pool.submit(call, prefill.url, "/v1/completions", pd_body), \
        pool.submit(call, decode.url, "/v1/completions", pd_body)
    pool.shutdown(wait=False)
    return futures


def _pd(prefill: Replica, boot: int, decode: Replica, body: dict) -> tuple:
    pre, dec = _start_pd(prefill, boot, decode, body)
    assert pre.result()[0] == 200
    return answer(*dec.result())


def _live(replica: Replica, state: str) -> float:
    return metrics(replica.url).get(LIVE % state, -1)  # -1: a scrape the busy engine did not answer in time


def _fails_and_frees(replica: Replica, client: Future, failed_before: float, since: float) -> None:
    """The survivor's client gets a KV-transfer error, and every page is back within the timeout."""
    status, body = client.result(timeout=TIMEOUT_S + 30)  # a stream's error event folds to status 500
    assert status in (500, 503) and body["error"]["code"] == "kv_transfer_failed", body
    wait_for(lambda: pages_all_back(metrics(replica.url)), f"pages back on {replica.url}", TIMEOUT_S + 30)
    assert time.monotonic() - since < TIMEOUT_S + 15, "freed long after the timeout"
    assert metrics(replica.url)[FAILED] == failed_before + 1


def test_decode_killed_mid_transfer(servers, short_answer):
    (prefill, boot), _ = servers[0]
    decode, spare = servers[1]
    failed_before = metrics(prefill.url)[FAILED]
    pre, dec = _start_pd(prefill, boot, decode, {"prompt": LONG, "max_tokens": 4, "temperature": 0})
    wait_for(lambda: _live(decode, "waiting_for_input") == 1, "the decode server's room registered")
    _signal(decode, signal.SIGSTOP)
    wait_for(lambda: _live(prefill, "transferring") == 1, "the prefill server pushing the KV")
    sigkill_replica(decode)
    killed_at = time.monotonic()
    _fails_and_frees(prefill, pre, failed_before, killed_at)
    with pytest.raises(Exception):
        dec.result(timeout=30)  # its server is gone: the connection broke
    assert _pd(prefill, boot, spare, SHORT) == short_answer, "the prefill server serves on"


def test_prefill_killed_mid_transfer(servers, short_answer):
    (spare, spare_boot), (prefill, boot) = servers[0]
    _, decode = servers[1]
    failed_before = metrics(decode.url)[FAILED]
    pre, dec = _start_pd(prefill, boot, decode, {"prompt": LONG, "max_tokens": 4, "temperature": 0})
    wait_for(lambda: _live(decode, "waiting_for_input") == 1, "the decode server's room registered")
    _signal(decode, signal.SIGSTOP)
    try:
        wait_for(lambda: _live(prefill, "transferring") == 1, "the prefill server pushing the KV")
        sigkill_replica(prefill)
    finally:
        _signal(decode, signal.SIGCONT)
    killed_at = time.monotonic()
    _fails_and_frees(decode, dec, failed_before, killed_at)
    with pytest.raises(Exception):
        pre.result(timeout=30)
    assert _pd(spare, spare_boot, decode, SHORT) == short_answer, "the decode server serves on"


def test_bootstrap_never_answered(servers, short_answer):
    (prefill, boot), _ = servers[0]
    _, decode = servers[1]
    # at once: a prefill request whose room no decode server ever claims, and a decode request
    # whose "prefill server" accepts the connection and never says a word
    before = metrics(prefill.url)[FAILED], metrics(decode.url)[FAILED]
    unclaimed = {**SHORT, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": next(_rooms)}
    with socket.socket() as mute, ThreadPoolExecutor(2) as pool:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        unanswered = {**unclaimed, "bootstrap_port": mute.getsockname()[1], "bootstrap_room": next(_rooms),
                      "stream": True}
        t0 = time.monotonic()
        pre = pool.submit(call, prefill.url, "/v1/completions", unclaimed)
        dec = pool.submit(call, decode.url, "/v1/completions", unanswered)
        _fails_and_frees(prefill, pre, before[0], t0)
        _fails_and_frees(decode, dec, before[1], t0)
    assert _pd(prefill, boot, decode, SHORT) == short_answer, "both serve on"


def test_a_decode_chat_stream_says_nothing_before_the_kv_came(servers):
    """A PD decode server's chat stream holds its role chunk until the first token (the KV has
    arrived): a gateway races the prefill against the decode answer's first bytes, and a stream
    that had begun with a role chunk kept a failed prefill from answering the client (it waited for
    the transfer timeout instead). Here the "prefill server" never answers: the stream's first
    event is the transfer error."""
    _, decode = servers[1]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "stream": True,
            "bootstrap_host": "127.0.0.1", "bootstrap_room": next(_rooms)}
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        host, port = decode.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S + 30)
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "bootstrap_port": mute.getsockname()[1]}),
                     {"content-type": "application/json"})
        r = conn.getresponse()
        lines = r.read().decode().splitlines()
        conn.close()
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert r.status == 200 and events[-1] == "[DONE]", events
    first = json.loads(events[0])
    assert first.get("error", {}).get("code") == "kv_transfer_failed", events
    wait_for(lambda: pages_all_back(metrics(decode.url)), "pages back", TIMEOUT_S + 30)
