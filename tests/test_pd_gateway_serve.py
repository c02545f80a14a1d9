"""The whole PD deployment as a user runs it, on loopback with the bundled SmolLM2 (CPU, fp32):
`ketch serve --disaggregation-mode prefill` + `--disaggregation-mode decode` behind
`ketch gateway --pd-disaggregation`, per transfer backend (tcp, nixl, mooncake, fake). The
gateway's greedy answers to test_parity's 20 prompts, stream and not, must equal one colocated
server's: text, finish reason and token counts. With tcp, nixl and mooncake the decode server
decodes from the KV that crossed the wire; with fake it runs each prompt itself (moves no bytes).
Afterwards every page is back on both servers and the transfers are counted as they happened.
Each answer's usage carries the decode server's TTFT split (`pd_timing`) through the gateway.
The PD servers prefill in chunks of 16 tokens (the colocated one in one go: fp32 output does not
depend on it), so the prefill server sends each prompt's KV in parts while the prompt runs.
"""
from __future__ import annotations

import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway_util import running_gateway, start_replica, stop, wait_healthy
from pd_util import answer, call
from server_util import free_port, metrics, pages_all_back, post, wait_for
from test_parity import PROMPTS

from ketch.disagg.config import IMPLEMENTED_BACKENDS

MAX_TOKENS = 16
CLIENTS = 4  # requests in flight at once: the servers batch, as under real load
CHUNK = 16  # the PD servers' prefill chunk: the prompts' first pages travel before their last chunk runs
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


def _skip_reason(backend: str) -> str | None:
    if backend not in IMPLEMENTED_BACKENDS:
        return f"the {backend} transfer backend is not implemented"
    module = {"nixl": "nixl", "mooncake": "mooncake"}.get(backend)
    if module is not None and importlib.util.find_spec(module) is None:
        return f"the {module} package is not installed"
    return None


def _bodies(stream: bool) -> list[dict]:
    extra = STREAM if stream else {}
    return [{"messages": [{"role": "user", "content": p}], "max_tokens": MAX_TOKENS,
             "temperature": 0, **extra} for p in PROMPTS]


def _answers(base: str, stream: bool, usages: list | None = None) -> list[tuple]:
    """The answers' (text, finish reason, token counts); their usage objects appended to `usages`."""
    with ThreadPoolExecutor(CLIENTS) as pool:
        got = list(pool.map(lambda b: call(base, "/v1/chat/completions", b), _bodies(stream)))
    if usages is not None:
        usages += [body.get("usage") or {} for _, body in got]
    return [answer(*g) for g in got]


@pytest.fixture(scope="module")
def colocated() -> list[tuple]:
    """The colocated server's answers (stream and not must agree; either is the reference)."""
    port = free_port()
    replica = start_replica(port)
    try:
        wait_healthy(replica)
        usages: list[dict] = []
        want = _answers(replica.url, stream=False, usages=usages)
        assert _answers(replica.url, stream=True, usages=usages) == want
        assert not any("pd_timing" in u for u in usages), "a colocated server has no PD TTFT split"
        return want
    finally:
        stop(replica.proc)


@pytest.fixture(scope="module", params=["tcp", "nixl", "mooncake", "fake"])
def deployment(request):
    """(gateway URL, prefill URL, decode URL, backend) for one transfer backend."""
    backend = request.param
    reason = _skip_reason(backend)
    if reason is not None:
        pytest.skip(reason)
    saved = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp"  # nixl's UCX over loopback tcp (the servers inherit it)
    boot = free_port()
    pd = ("--disaggregation-transfer-backend", backend, "--disaggregation-timeout", "60", "--chunked-prefill-size",
          str(CHUNK))
    prefill = start_replica(free_port(), "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                            str(boot), *pd)
    decode = start_replica(free_port(), "--disaggregation-mode", "decode", *pd)
    try:
        wait_healthy(prefill)
        wait_healthy(decode)
        with running_gateway("--pd-disaggregation", "--prefill", prefill.url, str(boot),
                             "--decode", decode.url) as (_, base):
            yield base, prefill.url, decode.url, backend
    finally:
        stop(prefill.proc)
        stop(decode.proc)
        if saved is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = saved


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_gateway_pd_answers_equal_colocated(deployment, colocated, stream):
    base, prefill, decode, backend = deployment
    for url in (prefill, decode):  # the other pass's prompts cached: each prompt would be one last chunk
        assert post(url, "/flush_cache", {})[0] == 200
    before = [metrics(url) for url in (prefill, decode)]
    usages: list[dict] = []
    got = _answers(base, stream, usages)
    for i, (g, w) in enumerate(zip(got, colocated)):
        assert g == w, f"prompt {i} {PROMPTS[i]!r} over {backend}"
    # the decode server's TTFT split reaches the client through the gateway (none on fake: no transfer)
    for u in usages:
        if backend == "fake":
            assert "pd_timing" not in u, u
            continue
        t = u["pd_timing"]
        assert t["prefill_ms"] > 0 and 0 <= t["transfer_ms"] <= t["kv_wait_ms"] and t["first_decode_ms"] >= 0, t
    for url in (prefill, decode):
        wait_for(lambda: pages_all_back(metrics(url)), f"pages back on {url}")
    after = [metrics(url) for url in (prefill, decode)]
    ended = 'ketch_pd_transfers_ended_total{outcome="%s"}'
    sent = after[0][ended % "succeeded"] - before[0][ended % "succeeded"]
    received = after[1][ended % "succeeded"] - before[1][ended % "succeeded"]
    assert sent == len(PROMPTS), "every prompt's KV left the prefill server once"
    # a decode server on the fake backend has no transfers: it ran the prompts itself
    assert received == (0 if backend == "fake" else len(PROMPTS))
    for m in after:
        assert m[ended % "failed"] == 0
    early = "ketch_pd_pages_sent_early_total"
    assert after[0][early] > before[0][early], "the prompts' first pages went while their later chunks ran"
