"""`ketch gateway` in front of two real `ketch serve` replicas (loopback, bundled SmolLM2, fp32),
driven by the openai SDK and raw HTTP: every route, streams relayed as generated, workers'
errors passed through unchanged, the gateway's own errors, round-robin spread, cache-aware prefix
affinity, a flood of 400s that must not open a breaker, a client that leaves mid-stream.

The replicas require an API key, so every gateway here has to send one: --worker-api-key for
one, keys in the worker URLs (http://:KEY@host:port) for the other. The two replicas serve the
whole module; the gateways are cheap and start per policy.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from urllib.parse import quote

import openai
import pytest
from gateway_util import MODEL, replicas, request, running_gateway, start_replica, stop, wait_healthy, workers
from server_util import connect, free_port, metrics, open_stream, pages_all_back, parse_metrics, wait_for

from ketch.gateway.sse import payloads

KEY = "worker-secret"
AUTH = {"authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "Hi"}]
BACKGROUND = "   ".join(f"Fact {i}: the {w} is kept in room {i * 7 % 13}." for i, w in enumerate(
    ["lamp", "atlas", "violin", "kettle", "compass", "globe", "anchor", "mirror", "ledger", "quill"]))
SYSTEMS = [f"You answer questions about museum {name}. {BACKGROUND}" for name in ("Alpha", "Borealis", "Cygnus")]


@pytest.fixture(scope="module")
def workers_up():
    with replicas(2, "--api-key", KEY) as rs:
        yield rs


@pytest.fixture(scope="module")
def gw_rr(workers_up):
    urls = [r.url for r in workers_up]
    with running_gateway("--worker-urls", *urls, "--policy", "round_robin", "--worker-api-key", KEY,
                         "--cb-failure-threshold", "2", "--health-check-interval-secs", "0.5") as (_, base):
        yield base


@pytest.fixture(scope="module")
def gw_ca(workers_up):
    urls = [r.url.replace("http://", f"http://:{KEY}@") for r in workers_up]
    with running_gateway("--worker-urls", *urls, "--policy", "cache_aware", "--load-interval-secs", "0.2") as (_, base):
        yield base


def sdk(base: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def test_models_and_both_generation_routes_stream_and_not(workers_up, gw_rr):
    direct, via = sdk(workers_up[0].url, KEY), sdk(gw_rr)
    assert [m.id for m in via.models.list().data] == [m.id for m in direct.models.list().data] == [MODEL]
    assert via.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{model} relayed
    for i in range(3):  # names a client picks: one route label, not a metrics series each
        with pytest.raises(openai.NotFoundError):
            via.models.retrieve(f"no-such-model-{i}")
    routes = request(gw_rr, "GET", "/metrics")[2].decode()
    assert 'route="/v1/models/{model}"' in routes and "no-such-model" not in routes
    expected = direct.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    raw = via.chat.completions.with_raw_response.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    assert raw.headers["x-ketch-worker"] in {r.url for r in workers_up}  # never the key
    whole = raw.parse()
    assert whole.choices[0].message.content == expected.choices[0].message.content
    assert whole.usage.completion_tokens == expected.usage.completion_tokens
    chunks = list(via.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    text = via.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    streamed = "".join(c.choices[0].text for c in via.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True))
    assert "Paris" in text.choices[0].text and streamed == text.choices[0].text


def test_a_stream_is_relayed_as_it_is_generated(gw_rr):
    """The first event reaches the client long before the last is generated: no buffering. The
    yardstick is the same generation asked whole through the gateway, in the same run (a clock
    bound held on one CPU and not on a faster one)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    t0 = time.monotonic()
    assert request(gw_rr, "POST", "/v1/completions", body)[0] == 200
    whole = time.monotonic() - t0
    conn, resp = open_stream(gw_rr, "/v1/completions", body)
    first = time.monotonic()  # open_stream returned after reading the first event
    events = 1
    while (line := resp.readline()) and not line.startswith(b"data: [DONE]"):
        events += line.startswith(b"data:")
    total = time.monotonic() - first
    conn.close()
    # events, not tokens: the detokenizer may hold a token back until the text is whole
    # 47 more tokens took a good part of a whole answer's time (a quarter, not more: a pause of a
    # loaded machine while the yardstick ran must not fail it) ...
    assert events >= 24 and total > whole / 4
    assert resp.getheader("content-type").startswith("text/event-stream")
    # ... and arrived over that while, not at once at the end (a buffering relay: total ≈ 0)


def test_worker_errors_pass_through_with_status_and_body(workers_up, gw_rr):
    bad = {"model": MODEL, "messages": HI, "max_tokens": -1}
    direct = request(workers_up[0].url, "POST", "/v1/chat/completions", bad, AUTH)
    via = request(gw_rr, "POST", "/v1/chat/completions", bad)
    assert via[0] == direct[0] == 400 and via[2] == direct[2]  # byte for byte
    assert json.loads(via[2])["error"]["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError, match="is not served here"):  # 404 from the worker
        sdk(gw_rr).completions.create(model="no-such-model", prompt="x", max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        sdk(gw_rr).chat.completions.create(model=MODEL, messages=HI, max_tokens=0, stream=True)
    # a gateway without the workers' key gets their 401, passed through (and the workers stay usable)
    with running_gateway("--worker-urls", workers_up[0].url) as (_, keyless):
        status, _, body = request(keyless, "POST", "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert workers(keyless)[workers_up[0].url]["breaker"] == "closed"


COUNT = [{"role": "user", "content": "Count from 1 to 10 separated by commas"}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
HELD_BACK = [  # streams in which a stop string or the tool-call parser holds tokens back
    ("/v1/chat/completions", {"messages": COUNT, "max_tokens": 40, "stop": ["5"]}),
    ("/v1/completions", {"prompt": "1, 2, 3, 4,", "max_tokens": 30, "stop": [" 7"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40,
                              "tools": WEATHER, "tool_choice": "required"}),
]


def _choices(body: bytes) -> list:
    """A stream's choices, event by event, without the tool calls' ids (drawn per request)."""
    events = [json.loads(p)["choices"] for p in payloads(body) if p != b"[DONE]"]
    for choice in (c for choices in events for c in choices):
        for call in (choice.get("delta") or {}).get("tool_calls") or ():
            call.pop("id", None)
    return events


@pytest.mark.parametrize("path, fields", HELD_BACK)
def test_a_stream_through_the_gateway_has_the_workers_events(workers_up, gw_rr, path, fields):
    """The gateway asks a resumable stream for its token ids and takes them out again: the events
    that carried nothing else (a token held back) go with them, so the client gets the events the
    worker sends it directly, none left empty."""
    body = {"model": MODEL, "temperature": 0, "stream": True, **fields}
    status, _, with_ids = request(workers_up[0].url, "POST", path, {**body, "return_token_ids": True}, AUTH)
    held = [c for c in _choices(with_ids) if c and not (c[0].get("delta") or c[0].get("text") or c[0]["finish_reason"])]
    assert status == 200 and held, "the case must hold a token back, or it tests nothing"
    direct = request(workers_up[0].url, "POST", path, body, AUTH)
    via = request(gw_rr, "POST", path, body)
    assert via[0] == direct[0] == 200
    assert _choices(via[2]) == _choices(direct[2])


def test_a_number_past_floats_range_in_a_stream_is_the_workers_400(workers_up, gw_rr):
    """1e400 is JSON; parsed it is inf, which the gateway must not re-encode as `Infinity` (not
    JSON) when it rewrites a resumable stream's body: the worker's 400 names the field."""
    raw = b'{"model": "%s", "prompt": "Hi", "max_tokens": 3, "top_p": 1e400, "stream": true}' % MODEL.encode()
    direct = request(workers_up[0].url, "POST", "/v1/completions", raw, AUTH)
    via = request(gw_rr, "POST", "/v1/completions", raw)
    assert via[0] == direct[0] == 400 and via[2] == direct[2]
    assert json.loads(via[2])["error"]["param"] == "top_p"


def test_the_gateways_own_bad_input_gets_openai_errors(gw_rr):
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # past the parser's recursion limit
    for path, body in [("/v1/chat/completions", b"{not json"), ("/v1/chat/completions", b"[1, 2]"),
                       ("/v1/chat/completions", b"\xff\xfe"), ("/v1/completions", deep), ("/workers", deep)]:
        status, _, answer = request(gw_rr, "POST", path, body)
        error = json.loads(answer)["error"]
        assert status == 400 and error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
    status, _, answer = request(gw_rr, "GET", "/v2/nothing")
    assert status == 404 and json.loads(answer)["error"]["code"] == "not_found"
    status, _, answer = request(gw_rr, "GET", "/v1/chat/completions")
    assert status == 405 and json.loads(answer)["error"]["code"] == "method_not_allowed"


def test_round_robin_spreads_requests_evenly(workers_up, gw_rr):
    seen = [sdk(gw_rr).completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=1)
            .headers["x-ketch-worker"] for _ in range(6)]
    assert all(a != b for a, b in zip(seen, seen[1:])) and sorted(set(seen)) == sorted(r.url for r in workers_up)


def test_a_flood_of_400s_keeps_every_breaker_closed(gw_rr):
    """4xx are the client's fault (PRIOR_ART.md, known failure 10): 20 of them through a gateway
    whose breakers open after 2 failures leave every worker available."""
    for _ in range(20):
        status, _, _ = request(gw_rr, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -5})
        assert status == 400
    states = workers(gw_rr)
    assert all(w["breaker"] == "closed" and w["available"] for w in states.values()), states
    m = parse_metrics(request(gw_rr, "GET", "/metrics")[2].decode())
    assert not [k for k in m if k.startswith("ketch_gateway_worker_errors_total")]
    assert sum(v for k, v in m.items() if k.startswith("ketch_gateway_responses_total") and '"400"' in k) >= 20
    assert sdk(gw_rr).completions.create(model=MODEL, prompt="Hello", max_tokens=1).choices[0].text is not None


def test_cache_aware_keeps_each_prefix_group_on_one_worker(workers_up, gw_ca):
    client, where, cached = sdk(gw_ca), {}, []
    for question in ("Where is the lamp?", "Where is the globe?", "Where is the quill?"):
        for g, system in enumerate(SYSTEMS):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=1)
            where.setdefault(g, []).append(raw.headers["x-ketch-worker"])
            cached.append((g, raw.parse().usage.prompt_tokens_details.cached_tokens))
    assert all(len(set(urls)) == 1 for urls in where.values()), where  # each group stayed on its worker
    assert {urls[0] for urls in where.values()} == {r.url for r in workers_up}  # groups spread over both
    assert all(tokens > 100 for _, tokens in cached[len(SYSTEMS):])  # repeats hit the worker's prefix cache
    m = parse_metrics(request(gw_ca, "GET", "/metrics")[2].decode())
    assert m['ketch_gateway_routing_decisions_total{policy="cache_aware",reason="cache_hit"}'] == 6
    assert m["ketch_gateway_cache_match_ratio_count"] == 9
    assert m['ketch_gateway_cache_match_ratio_bucket{le="0.3"}'] == 3  # the three first requests
    assert all(m[f'ketch_gateway_worker_tree_chars{{worker="{r.url}"}}'] > 0 for r in workers_up)


def tree_chars(base: str, urls: list[str]) -> dict[str, float]:
    m = parse_metrics(request(base, "GET", "/metrics")[2].decode())
    return {url: m.get(f'ketch_gateway_worker_tree_chars{{worker="{url}"}}', 0) for url in urls}


def test_a_prompt_its_worker_refused_leaves_its_tree(workers_up, gw_ca):
    """cache_aware's tree says what a worker probably cached; a prompt the worker refused (too long
    for its context) cached nothing there, so its text leaves the tree again. It stayed: one 20 MB
    prompt made that worker's tree the largest for good, and every new prefix went elsewhere."""
    urls = [r.url for r in workers_up]
    before = tree_chars(gw_ca, urls)
    long = "hello world " * 20000  # ~40,000 tokens: past the 8,192-token context, tokenized to find out
    for stream in (False, True):
        status, _, body = request(gw_ca, "POST", "/v1/completions", {"model": MODEL, "prompt": long, "max_tokens": 1,
                                                                     "stream": stream})
        assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded"
    assert tree_chars(gw_ca, urls) == before
    accepted = request(gw_ca, "POST", "/v1/completions", {"model": MODEL, "prompt": long[:3000], "max_tokens": 1})
    assert accepted[0] == 200 and sum(tree_chars(gw_ca, urls).values()) >= sum(before.values()) + 3000 - 100


def test_a_restarted_worker_starts_with_an_empty_tree():
    """A worker whose server restarted (a new x-ketch-instance on its /health) has an empty cache:
    what cache_aware learnt of the old one is dropped, not routed by."""
    with replicas(1) as (replica,):
        with running_gateway("--worker-urls", replica.url, "--policy", "cache_aware",
                             "--health-check-interval-secs", "0.2") as (_, base):
            wait_for(lambda: workers(base)[replica.url]["instance"] is not None, "the first probe", 30)
            old = workers(base)[replica.url]["instance"]
            body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1}
            assert request(base, "POST", "/v1/completions", body)[0] == 200
            assert tree_chars(base, [replica.url])[replica.url] > 0
            stop(replica.proc)
            revived = start_replica(replica.port)
            try:
                wait_healthy(revived)
                wait_for(lambda: workers(base)[replica.url]["instance"] not in (None, old), "the new instance", 30)
                assert tree_chars(base, [replica.url])[replica.url] == 0
            finally:
                stop(revived.proc)


def test_a_client_leaving_mid_stream_aborts_the_generation_on_the_worker(workers_up, gw_rr):
    conn, resp = open_stream(gw_rr, "/v1/completions", {"model": MODEL, "prompt": "Count:", "max_tokens": 2000,
                                                         "ignore_eos": True})
    url = resp.getheader("x-ketch-worker")
    assert metrics(url, AUTH)["ketch_num_requests_running"] == 1
    conn.close()  # 2000 tokens would take minutes on this CPU: a prompt end means an abort
    wait_for(lambda: metrics(url, AUTH)["ketch_num_requests_running"] == 0, "the worker to abort", 20)
    wait_for(lambda: workers(gw_rr)[url]["in_flight"] == 0, "the gateway to give its slot back", 20)
    assert workers(gw_rr)[url]["breaker"] == "closed"  # the client left: not the worker's fault


def test_gateway_metrics_count_requests_per_worker(workers_up, gw_rr):
    m = parse_metrics(request(gw_rr, "GET", "/metrics")[2].decode())
    for r in workers_up:
        assert m[f'ketch_gateway_requests_total{{route="completions",worker="{r.url}"}}'] >= 3
        assert m[f'ketch_gateway_worker_breaker_state{{worker="{r.url}"}}'] == 0
        assert m[f'ketch_gateway_worker_healthy{{worker="{r.url}"}}'] == 1
        assert m[f'ketch_gateway_worker_in_flight{{worker="{r.url}"}}'] == 0
    assert m['ketch_gateway_routing_decisions_total{policy="round_robin",reason="round_robin"}'] >= 6
    assert m["ketch_gateway_workers"] == 2


def test_workers_join_and_leave_at_run_time_behind_the_gateways_own_key(workers_up):
    a, b = (r.url for r in workers_up)
    door = {"authorization": "Bearer gw-key"}
    with running_gateway("--worker-urls", a, "--policy", "round_robin", "--worker-api-key", KEY,
                         "--api-key", "gw-key", "--max-request-bytes", "4096") as (_, base):
        status, _, body = request(base, "GET", "/workers")
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert request(base, "GET", "/health")[0] == 200  # open, for load balancers
        assert request(base, "HEAD", "/health")[:3:2] == (200, b"")  # some probe with HEAD, as a worker allows
        with pytest.raises(openai.AuthenticationError):
            sdk(base, "wrong").models.list()
        status, _, body = request(base, "POST", "/v1/completions", b"{" + b" " * 5000 + b"}", door)
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"

        for bad, status_code, code in [({"url": "ftp://x:1"}, 400, "invalid_value"),
                                       ({"url": a, "extra": 1}, 400, "invalid_value"),
                                       ({"url": f"http://127.0.0.1:{free_port()}"}, 400, "worker_unreachable"),
                                       ({"url": a + "/"}, 409, "worker_exists")]:
            status, _, body = request(base, "POST", "/workers", bad, door)
            error = json.loads(body)["error"]
            assert (status, error["code"]) == (status_code, code), body
            assert error["param"] in ("url", "extra") and error["message"]
        status, _, body = request(base, "POST", "/workers", {"url": b}, door)
        assert status == 201 and json.loads(body)["url"] == b
        # the same server under another name (its x-ketch-instance says so): counted twice, it would
        # get two shares of the requests and two half prefix trees
        alias = b.replace("127.0.0.1", "localhost")
        status, _, body = request(base, "POST", "/workers", {"url": alias}, door)
        error = json.loads(body)["error"]
        assert (status, error["code"], error["param"]) == (409, "worker_exists", "url") and b in error["message"], body
        assert sorted(workers(base, door)) == sorted([a, b])
        client = sdk(base, "gw-key")
        seen = {client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1)
                .headers["x-ketch-worker"] for _ in range(4)}
        assert seen == {a, b}

        status, _, body = request(base, "DELETE", "/workers/" + quote(a, safe=""), headers=door)
        assert status == 200 and json.loads(body) == {"url": a, "removed": True}
        seen = {client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1)
                .headers["x-ketch-worker"] for _ in range(3)}
        assert seen == {b} and list(workers(base, door)) == [b]
        status, _, body = request(base, "DELETE", "/workers/" + quote(a, safe=""), headers=door)
        assert status == 404 and json.loads(body)["error"]["code"] == "worker_not_found"
        assert request(base, "DELETE", "/workers/" + quote(b, safe=""), headers=door)[0] == 200
        started = time.monotonic()
        status, _, body = request(base, "POST", "/v1/completions", {"model": MODEL, "prompt": "x"}, door)
        assert status == 503 and json.loads(body)["error"]["code"] == "no_available_workers"
        assert time.monotonic() - started < 2 and request(base, "GET", "/health")[0] == 503


def test_a_client_leaving_before_a_whole_answer_aborts_the_generation(workers_up, gw_rr):
    """Not streamed: the gateway is still waiting for the worker's answer when the client goes."""
    def running() -> float:
        return sum(metrics(r.url, AUTH)["ketch_num_requests_running"] for r in workers_up)

    conn = connect(gw_rr)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Count:", "max_tokens": 2000,
                                                        "ignore_eos": True}), {"content-type": "application/json"})
    wait_for(lambda: running() == 1, "the worker to start generating", 20)
    conn.close()
    wait_for(lambda: running() == 0, "the worker to abort", 20)
    wait_for(lambda: all(w["in_flight"] == 0 for w in workers(gw_rr).values()), "the gateway's slots", 20)


def test_sigterm_ends_what_is_still_open_at_the_deadline_with_an_answer(workers_up):
    """SIGTERM with a short stream, a long stream and a long whole answer open through the gateway:
    the short one finishes; at --shutdown-timeout the long stream ends with a `server_shutdown`
    error event and [DONE] (not a cut connection), the whole answer is a 503 `server_shutdown`;
    the gateway exits 0, and the workers abort what it cut (every page back, nothing running)."""
    timeout = 8
    long = {"model": MODEL, "prompt": "Count:", "max_tokens": 4000, "ignore_eos": True}

    def running() -> float:
        return sum(metrics(r.url, AUTH)["ketch_num_requests_running"] for r in workers_up)

    with running_gateway("--worker-urls", *(r.url for r in workers_up), "--worker-api-key", KEY,
                         "--shutdown-timeout", str(timeout)) as (proc, base):
        _, cut_stream = open_stream(base, "/v1/completions", long)
        whole: list[tuple[int, dict[str, str], bytes]] = []
        waiting = threading.Thread(target=lambda: whole.append(
            request(base, "POST", "/v1/completions", long, timeout=timeout + 60)))
        waiting.start()
        wait_for(lambda: running() == 2, "both long requests on the workers")
        _, short = open_stream(base, "/v1/completions", {"model": MODEL, "prompt": "The capital of France is",
                                                         "max_tokens": 16, "ignore_eos": True})
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = short.read().decode()
        assert '"finish_reason": "length"' in rest and rest.rstrip().endswith("data: [DONE]"), rest[-300:]
        cut = cut_stream.read().decode()
        assert '"code": "server_shutdown"' in cut and cut.rstrip().endswith("data: [DONE]"), cut[-300:]
        waiting.join(timeout=timeout + 60)
        status, _, body = whole[0]
        assert status == 503 and json.loads(body)["error"]["code"] == "server_shutdown", body
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - started >= timeout - 1
    wait_for(lambda: all(pages_all_back(metrics(r.url, AUTH)) for r in workers_up), "the workers to abort", 20)
