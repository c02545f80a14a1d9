"""POST /flush_cache on a real `ketch serve` (bundled SmolLM2, fp32, CPU) with an API key and two
API processes: it frees every cached page (/metrics shows none left; the same prompt again reports
no cached tokens), from either API process; a request streaming through it keeps its pages and
its greedy output; a wrong or missing key is a JSON 401 that flushes nothing. And `ketch bench serve
--dataset-name multiturn --flush-cache` against the same server: round 1 cold, the later rounds
served partly from the cache, each round's prompt the previous one plus its answer and a turn."""
from __future__ import annotations

import json

import pytest
from bench_util import printed
from bench_util import shared_tokenizer, tok  # noqa: F401  (fixtures)
from server_util import connect, metrics, pages_all_back, running_server, wait_for

KEY = "flush-k3y"
AUTH = {"authorization": f"Bearer {KEY}"}
PROCESS_HEADER = "x-ketch-api-process"
MAX_TRIES = 64  # new connections until the kernel hands one to a given process: 2**-64 to fail
TURN, ANSWER = 24, 6  # the multi-turn bench's turn and answer lengths (tokens)
PROMPT = "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz"


@pytest.fixture(scope="module")
def server():
    with running_server("--api-key", KEY, "--api-server-count", "2") as running:
        yield running


def call(base: str, method: str, path: str, body: dict | None = None,
         headers: dict | None = None) -> tuple[int, int, dict]:
    """One request on a new connection: (status, the API process that answered, the JSON answer)."""
    conn = connect(base)
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"content-type": "application/json", **(AUTH if headers is None else headers)})
        resp = conn.getresponse()
        return resp.status, int(resp.getheader(PROCESS_HEADER, "-1")), json.loads(resp.read())
    finally:
        conn.close()


def flush_from(base: str, process: int) -> dict:
    """POST /flush_cache to API process `process`: new connections until one is accepted by it (a
    GET /v1/models says which), then the flush on that connection (it stays with that process)."""
    for _ in range(MAX_TRIES):
        conn = connect(base)
        try:
            conn.request("GET", "/v1/models", headers=AUTH)
            resp = conn.getresponse()
            resp.read()
            if int(resp.getheader(PROCESS_HEADER)) != process:
                continue
            conn.request("POST", "/flush_cache", headers=AUTH)
            resp = conn.getresponse()
            assert resp.status == 200 and int(resp.getheader(PROCESS_HEADER)) == process
            return json.loads(resp.read())
        finally:
            conn.close()
    raise AssertionError(f"API process {process} never answered in {MAX_TRIES} connections")


def complete(base: str, max_tokens: int = 4) -> dict:
    status, _, body = call(base, "POST", "/v1/completions",
                           {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    return body


def scrape(base: str) -> dict[str, float]:
    return metrics(base, AUTH)


@pytest.mark.parametrize("process", [0, 1])
def test_flush_frees_every_cached_page_from_either_api_process(server, process):
    _, base = server
    complete(base)
    assert complete(base)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache works
    wait_for(lambda: pages_all_back(scrape(base)), "the requests' pages back in the cache")
    cached = scrape(base)["ketch_kv_pages_cached"]
    assert cached > 0
    answer = flush_from(base, process)
    assert answer == {"object": "flush_cache", "freed_pages": cached, "freed_host_pages": 0}
    after = scrape(base)
    assert after["ketch_kv_pages_cached"] == 0 and after["ketch_kv_pages_free"] == after["ketch_kv_pages_total"]
    assert pages_all_back(after)
    assert complete(base)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # cold again


def test_a_wrong_or_missing_key_is_a_401_and_flushes_nothing(server):
    _, base = server
    complete(base)
    wait_for(lambda: pages_all_back(scrape(base)), "the request's pages back in the cache")
    cached = scrape(base)["ketch_kv_pages_cached"]
    assert cached > 0
    for headers in ({"authorization": "Bearer wrong"}, {}):
        status, _, body = call(base, "POST", "/flush_cache", headers=headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert scrape(base)["ketch_kv_pages_cached"] == cached


def test_a_request_streaming_through_the_flush_keeps_its_pages_and_its_output(server):
    _, base = server
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    want = complete(base, 24)["choices"][0]["text"]  # cold: what the streamed one will be
    flush_from(base, 0)
    conn = connect(base)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"content-type": "application/json", **AUTH})
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline().decode()  # its first token has arrived: it is running, its prompt published
        answer = flush_from(base, 1)
        during = scrape(base)
        rest = first + resp.read().decode()
    finally:
        conn.close()
    assert during["ketch_num_requests_running"] == 1, "the request ended before the flush: make it longer"
    assert during["ketch_kv_pages_cached"] > 0 and during["ketch_kv_page_refs_unaccounted"] == 0  # its pages, locked
    assert answer["freed_pages"] == 0  # nothing but the running request's pages was cached
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
    assert "".join(c["text"] for e in events for c in e["choices"]) == want
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    wait_for(lambda: pages_all_back(scrape(base)), "the request's pages back in the cache")
    assert flush_from(base, 0)["freed_pages"] > 0 and scrape(base)["ketch_kv_pages_cached"] == 0


def test_bench_multiturn_starts_cold_and_later_rounds_hit_the_cache(server, tmp_path, capsys, tok):
    from ketch.cli import main

    _, base = server
    common = ["bench", "serve", "--base-url", base, "--api-key", KEY, "--dataset-name", "multiturn",
              "--multiturn-turn-len", str(TURN), "--random-output-len", str(ANSWER), "--seed", "11", "--disable-tqdm"]

    def bench(clients: int, rounds: int, *more: str) -> dict:
        out = tmp_path / "multiturn.json"
        assert main([*common, "--multiturn-clients", str(clients), "--multiturn-rounds", str(rounds), *more,
                     "--output-file", str(out)]) == 0
        return json.loads(out.read_text())

    doc = bench(2, 3, "--flush-cache")
    reqs, mt = doc["requests"], doc["metrics"]["multiturn"]
    assert all(r["success"] and r["output_len"] == ANSWER for r in reqs)
    first, *later = mt["per_round"]
    assert first["cached_tokens"] == 0 and first["cache_hit_rate"] == 0 and first["prompt_tokens"] == 2 * TURN
    assert all(r["cache_hit_rate"] > 0 for r in later) and mt["cache_hit_rate_rounds_2plus"] > 0
    rows = printed(capsys.readouterr().out)
    assert rows["Round 1 cache hit rate"].startswith("0.00%") and float(rows["Mean TTFT of rounds >= 2 (ms)"]) > 0
    for c in (0, 1):  # each round sends the whole conversation: the last prompt, its answer and a new turn
        conversation = [r for r in reqs if r["client"] == c]
        assert [r["round"] for r in conversation] == [1, 2, 3]
        for prev, nxt in zip(conversation, conversation[1:]):
            assert nxt["prompt_len"] >= prev["prompt_len"] + prev["output_len"] + TURN, (prev, nxt)
            # the previous prompt's full pages (16 tokens: the default page size) come from the cache, less at most
            # the page where the answer was appended (text re-tokenized there may merge across the seam)
            assert nxt["cached_tokens"] >= prev["prompt_len"] // 16 * 16 - 16
    # client 0's first turn is cached now: a run of it alone hits, unless --flush-cache empties the cache first
    assert bench(1, 1)["requests"][0]["cached_tokens"] > 0
    assert bench(1, 1, "--flush-cache")["requests"][0]["cached_tokens"] == 0
    capsys.readouterr()
