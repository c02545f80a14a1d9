"""`ketch serve --disaggregation-mode prefill|decode` as real processes on loopback (the bundled
SmolLM2, CPU), the test playing the PD gateway: the same body plus bootstrap_host / port / room
goes to the prefill and the decode server at once; the decode server's answer is the client's.
Greedy answers (text, finish reason, usage) must equal a colocated server's, stream or not,
completions and chat, over tcp and nixl. A decode request whose prefill never comes fails within
the timeout, all its pages come back, and the server keeps serving."""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway_util import start_replica, stop, wait_healthy
from pd_util import answer, call
from server_util import free_port, metrics, pages_all_back, post, wait_for

DECODE_TIMEOUT_S = 8.0  # the decode side's --disaggregation-timeout: the fault test waits this long; every passing
# room on this server must make each of its stages within it too, so not less (a pause of a loaded
# 2-core machine must not fail them)
PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):"]
CHATS = [[{"role": "user", "content": "Say hello in French."}], [{"role": "user", "content": "What is 2+2?"}]]
_rooms = itertools.count(1000)


def _nixl_ready() -> bool:
    return importlib.util.find_spec("nixl") is not None


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def servers(request):
    """(colocated, prefill, decode) base URLs and the prefill server's bootstrap port."""
    backend = request.param
    if backend == "nixl" and not _nixl_ready():
        pytest.skip("nixl is not installed")
    saved = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp"  # nixl's UCX over loopback tcp (the servers inherit it)
    boot = free_port()
    started = [start_replica(free_port()),
               start_replica(free_port(), "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend",
                             backend, "--disaggregation-bootstrap-port", str(boot), "--disaggregation-timeout", "30"),
               start_replica(free_port(), "--disaggregation-mode", "decode", "--disaggregation-transfer-backend",
                             backend, "--disaggregation-timeout", str(DECODE_TIMEOUT_S))]
    try:
        for r in started:
            wait_healthy(r)
        yield started[0].url, started[1].url, started[2].url, boot
    finally:
        for r in started:
            stop(r.proc)
        if saved is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = saved


def pd_call(prefill: str, decode: str, boot: int, path: str, body: dict) -> tuple[tuple[int, dict], tuple[int, dict]]:
    """What a PD gateway does: the same body with one room to both servers at once."""
    pd_body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": next(_rooms)}
    with ThreadPoolExecutor(2) as pool:
        pre = pool.submit(call, prefill, path, pd_body)
        dec = pool.submit(call, decode, path, pd_body)
        return pre.result(), dec.result()


def bodies() -> list[tuple[str, dict]]:
    out = []
    for stream in (False, True):
        extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        out += [("/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0, **extra}) for p in PROMPTS]
        out += [("/v1/chat/completions", {"messages": m, "max_tokens": 12, "temperature": 0, **extra}) for m in CHATS]
    return out


def test_greedy_answers_match_colocated(servers, request):
    colocated, prefill, decode, boot = servers
    every = bodies()
    # tcp takes every shape; nixl (slower per room over UCX tcp) one of each route and mode
    chosen = every if "tcp" in request.node.name else [every[0], every[-1]]
    for path, body in chosen:
        want = answer(*call(colocated, path, body))
        pre, dec = pd_call(prefill, decode, boot, path, body)
        assert answer(*dec) == want, (path, body)
        text, _, prompt_tokens, completion_tokens = answer(*pre)  # the first token only; a gateway drops it
        assert (prompt_tokens, completion_tokens) == (want[2], 1)
    for base in (prefill, decode):
        wait_for(lambda: pages_all_back(metrics(base)), f"pages back on {base}")


def test_bootstrap_fields_checked(servers):
    colocated, prefill, decode, boot = servers
    body = {"prompt": PROMPTS[0], "max_tokens": 4}
    for base in (prefill, decode):
        status, err = post(base, "/v1/completions", body)
        assert status == 400 and err["error"]["param"] == "bootstrap_host", err
        status, err = post(base, "/v1/chat/completions", {"messages": CHATS[0], "bootstrap_host": "127.0.0.1",
                                                            "bootstrap_port": boot})
        assert status == 400 and err["error"]["param"] == "bootstrap_room", err
        status, err = post(base, "/v1/completions", {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot,
                                                      "bootstrap_room": 1 << 63})
        assert status == 400 and err["error"]["param"] == "bootstrap_room", err
        status, err = post(base, "/v1/completions", {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": "x",
                                                      "bootstrap_room": 1})
        assert status == 400 and err["error"]["param"] == "bootstrap_port", err
    status, err = post(colocated, "/v1/completions", {**body, "bootstrap_room": 5})
    assert status == 400 and err["error"]["param"] == "bootstrap_room", err


def test_decode_whose_prefill_never_comes(servers):
    colocated, prefill, decode, boot = servers
    lost = free_port()  # nothing listens there: the decode side never finds its prefill server
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": lost, "bootstrap_room": next(_rooms)}
    t0 = time.monotonic()
    status, err = call(decode, "/v1/completions", body)
    assert time.monotonic() - t0 < DECODE_TIMEOUT_S + 10
    assert status != 200 and "KV transfer failed" in json.dumps(err), err
    wait_for(lambda: pages_all_back(metrics(decode)), "the decode server's pages back")
    # a room the prefill server never hears of fails the same way (here in a stream: an error event)
    status, err = call(decode, "/v1/completions", {**body, "bootstrap_port": boot, "bootstrap_room": next(_rooms),
                                                   "stream": True})
    assert status != 200 and "KV transfer failed" in json.dumps(err), err
    wait_for(lambda: pages_all_back(metrics(decode)), "the decode server's pages back")
    # and it keeps serving
    pre, dec = pd_call(prefill, decode, boot, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0})
    assert answer(*dec) == answer(*call(colocated, "/v1/completions",
                                        {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}))


def test_a_small_prefill_pool_takes_a_long_output():
    """The usual PD layout gives the prefill server less KV memory than the decode server: the
    prefill side holds the prompt and its first token only, so a request whose prompt + max_tokens
    is past the prefill pool (not past the decode pool) is served. It was a 400 from the prefill
    server ("prompt + max_tokens ... exceeds the KV cache capacity"), found by an exploratory run."""
    boot = free_port()
    started = [start_replica(free_port(), "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                             str(boot), "--disaggregation-timeout", "30", "--page-size", "16",
                             "--kv-cache-memory", "2000000"),
               start_replica(free_port(), "--disaggregation-mode", "decode", "--disaggregation-timeout", "30")]
    try:
        for r in started:
            wait_healthy(r)
        prefill, decode = (r.url for r in started)
        capacity = 16 * int(metrics(prefill)["ketch_kv_pages_total"])
        assert 16 < capacity < 1000 < 16 * metrics(decode)["ketch_kv_pages_total"], capacity
        body = {"prompt": PROMPTS[0], "max_tokens": capacity + 16, "temperature": 0, "ignore_eos": True}
        pre, dec = pd_call(prefill, decode, boot, "/v1/completions", body)
        assert pre[0] == 200 and answer(*pre)[3] == 1, pre
        assert answer(*dec)[3] == capacity + 16
        # a prompt the prefill pool cannot hold with its first token: a 400 naming it, coded as any such
        too_long = {"prompt": "one two three " * capacity, "max_tokens": 1, "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": boot, "bootstrap_room": next(_rooms)}
        status, err = post(prefill, "/v1/completions", too_long)
        assert status == 400 and err["error"]["param"] == "prompt", err
        assert err["error"]["code"] == "context_length_exceeded" and "prefill server" in err["error"]["message"], err
        for base in (prefill, decode):
            wait_for(lambda: pages_all_back(metrics(base)), f"pages back on {base}")
    finally:
        for r in started:
            stop(r.proc)
