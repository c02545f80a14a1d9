"""`ketch bench serve`: metric math, prompt datasets, the client's SSE framing, splitting and merging client
processes, CLI runs against a stub OpenAI server and against the fake server started for real."""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
from typing import Callable
from urllib.parse import urlsplit

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ketch.bench import fake_server as fake_server_module
from ketch.bench.datasets import random_requests, sharegpt_requests
from ketch.bench.serve_http import _Exchange
from ketch.bench.serve_load import Load, LoadRun
from ketch.bench.serve_metrics import RequestResult, compute_metrics
from ketch.bench.serve_procs import merge, split
from ketch.cli import main
from ketch.text.tokenizer import Tokenizer

METRIC_NAMES = [
    "Successful requests", "Benchmark duration (s)", "Total input tokens", "Total generated tokens",
    "Request throughput (req/s)", "Input token throughput (tok/s)", "Output token throughput (tok/s)",
    "Total token throughput (tok/s)", "Concurrency", "Mean E2E Latency (ms)", "Median E2E Latency (ms)",
    "P99 E2E Latency (ms)", "Mean TTFT (ms)", "Median TTFT (ms)", "P99 TTFT (ms)", "Mean TPOT (ms)",
    "Median TPOT (ms)", "P99 TPOT (ms)", "Mean ITL (ms)", "Median ITL (ms)", "P95 ITL (ms)", "P99 ITL (ms)",
    "Max ITL (ms)",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load()


# ---------------------------------------------------------------- metric math

def test_metrics_on_hand_made_timings():
    a = RequestResult(success=True, prompt_len=100, output_len=10, ttft=0.1, latency=1.0, itl=[0.1] * 9)
    b = RequestResult(success=True, prompt_len=50, output_len=5, ttft=0.3, latency=2.0, itl=[0.2, 0.4, 0.5, 0.6])
    failed = RequestResult(success=False, prompt_len=70, error="HTTP 500")
    m = compute_metrics([a, b, failed], duration_s=4.0)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (2, 1, 150, 15)
    assert m.request_throughput == pytest.approx(0.5)
    assert m.input_throughput == pytest.approx(37.5)
    assert m.output_throughput == pytest.approx(3.75)
    assert m.total_throughput == pytest.approx(41.25)
    assert m.concurrency == pytest.approx(0.75)  # (1 s + 2 s) of latency over 4 s
    assert m.mean_e2e_ms == pytest.approx(1500) and m.median_e2e_ms == pytest.approx(1500)
    assert m.p99_e2e_ms == pytest.approx(1000 + 0.99 * 1000)  # linear between the two ranks
    assert m.mean_ttft_ms == pytest.approx(200) and m.p99_ttft_ms == pytest.approx(100 + 0.99 * 200)
    # TPOT: a = 0.9 s / 9 = 100 ms, b = 1.7 s / 4 = 425 ms
    assert m.mean_tpot_ms == pytest.approx(262.5) and m.median_tpot_ms == pytest.approx(262.5)
    assert m.p99_tpot_ms == pytest.approx(100 + 0.99 * 325)
    # ITL pools the 13 gaps: nine 100s, then 200, 400, 500, 600
    assert m.mean_itl_ms == pytest.approx((900 + 1700) / 13)
    assert m.median_itl_ms == pytest.approx(100)
    assert m.max_itl_ms == pytest.approx(600)
    assert m.p95_itl_ms == pytest.approx(500 + 0.4 * 100)  # rank 0.95 * 12 = 11.4
    assert m.p99_itl_ms == pytest.approx(500 + 0.88 * 100)  # rank 11.88


def test_metrics_single_token_outputs_have_no_tpot_and_empty_runs_are_zero():
    one = RequestResult(success=True, prompt_len=3, output_len=1, ttft=0.2, latency=0.2)
    m = compute_metrics([one], duration_s=1.0)
    assert m.mean_tpot_ms == 0.0 and m.mean_itl_ms == 0.0 and m.mean_ttft_ms == pytest.approx(200)
    none = compute_metrics([RequestResult(error="x")], duration_s=1.0)
    assert none.completed == 0 and none.failed == 1 and none.concurrency == 0.0 and none.p99_e2e_ms == 0.0
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([one], duration_s=0.0)


# ---------------------------------------------------------------- datasets

def test_random_lengths_in_range_and_reproducible(tok):
    reqs = random_requests(tok, 30, 40, 20, 0.5, seed=7)
    assert all(20 <= r.prompt_len <= 40 for r in reqs)
    assert all(10 <= r.output_len <= 20 for r in reqs)
    assert all(len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 1  # actually spread, not pinned to one length
    assert random_requests(tok, 30, 40, 20, 0.5, seed=7) == reqs
    assert random_requests(tok, 30, 40, 20, 0.5, seed=8) != reqs
    fixed = random_requests(tok, 5, 33, 9, 1.0, seed=0)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(33, 9)] * 5
    with pytest.raises(ValueError, match="random_range_ratio"):
        random_requests(tok, 1, 8, 8, 1.5, seed=0)


def test_sharegpt_parsing_and_filters(tok, tmp_path):
    answer = "The capital of France is Paris, a city on the Seine."
    data = [
        {"conversations": [{"from": "human", "value": "What is the capital city of France, please?"},
                           {"from": "gpt", "value": answer}, {"from": "human", "value": "ignored"}]},
        {"conversations": [{"from": "gpt", "value": "a greeting that is not a prompt"},
                           {"from": "human", "value": "Tell me three facts about the planet Mars."},
                           {"from": "gpt", "value": "It is red, it is cold, and it has two moons."}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": answer}]},  # prompt too short
        {"conversations": [{"from": "human", "value": "word " * 1100}, {"from": "gpt", "value": answer}]},  # too long
        {"conversations": [{"from": "human", "value": "A question without any answer at all?"}]},
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(str(path), tok, 10, seed=0)
    assert sorted(r.prompt for r in reqs) == ["Tell me three facts about the planet Mars.",
                                              "What is the capital city of France, please?"]
    paris = next(r for r in reqs if "France" in r.prompt)
    assert paris.output_len == len(tok.encode(answer, add_special_tokens=False))
    assert paris.prompt_len == len(tok.encode(paris.prompt, add_special_tokens=False))
    assert sharegpt_requests(str(path), tok, 10, seed=0) == reqs
    assert len(sharegpt_requests(str(path), tok, 1, seed=0)) == 1
    assert {r.output_len for r in sharegpt_requests(str(path), tok, 10, seed=0, output_len=12)} == {12}
    with pytest.raises(ValueError, match="dataset_path"):
        sharegpt_requests(str(tmp_path / "missing.json"), tok, 10, seed=0)


# ---------------------------------------------------------------- stub server and CLI

def _chunk_sizes(max_tokens: int) -> list[int]:
    """Tokens per streamed chunk: alternately 1 and 2, so some chunks carry several tokens."""
    sizes, left, i = [], max_tokens, 0
    while left:
        sizes.append(min(1 + i % 2, left))
        left -= sizes[-1]
        i += 1
    return sizes


class Stub:
    """A deterministic OpenAI streaming server; a request for which `fail(body)` holds gets a 500."""

    def __init__(self, fail: Callable[[dict], bool], short: bool = False) -> None:
        self.fail = fail
        self.short = short  # stop one token early, like a server that ignores ignore_eos
        self.bodies: list[dict] = []
        self.active = self.max_active = 0
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.chat)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    async def completions(self, request: Request):
        return await self._serve(await request.json(), chat=False)

    async def chat(self, request: Request):
        return await self._serve(await request.json(), chat=True)

    async def _serve(self, body: dict, chat: bool):
        self.bodies.append(body)
        if self.fail(body):
            return JSONResponse({"error": {"message": "stub failure", "type": "server_error"}}, status_code=500)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        # usage that no tokenizer would give: proves the bench takes the server's counts (completions);
        # the chat route reports none, so the bench must count the text itself
        n_out = max(1, body["max_tokens"] - 1) if self.short else body["max_tokens"]
        usage = {"prompt_tokens": 1000 + len(body.get("prompt", "")), "completion_tokens": n_out}

        async def events():
            for n in _chunk_sizes(n_out):
                await asyncio.sleep(0.003)  # simulated decode time, so requests overlap
                piece = " tok" * n
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                yield f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"
            self.active -= 1  # before the client can see the end of the stream
            if not chat:
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(autouse=True)
def _shared_tokenizer(request, monkeypatch):
    """The CLI loads the bundled tokenizer per run: hand it the module's one (seconds each on 2 cores)."""
    if "tok" in request.fixturenames:
        shared = request.getfixturevalue("tok")
        monkeypatch.setattr(Tokenizer, "load", classmethod(lambda cls, path=None: shared))


@pytest.fixture
def stub_server():
    servers = []

    def start(fail: Callable[[dict], bool] = lambda body: False, short: bool = False) -> tuple[Stub, str]:
        stub = Stub(fail, short)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)  # connections made before uvicorn starts wait in the backlog: no readiness poll
        server = uvicorn.Server(uvicorn.Config(stub.app, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread, sock))
        return stub, f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, thread, sock in servers:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _printed(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        label, sep, value = line.partition(":")
        if sep and value.strip():
            rows[label] = value.strip()
    return rows


def test_cli_against_stub(stub_server, tmp_path, capsys, tok):
    # the same arguments give the same prompts: the 3rd one (not the warmup's, which is the 1st) fails
    sent = random_requests(tok, 10, 24, 9, 0.3, seed=3)
    stub, url = stub_server(fail=lambda body: body["prompt"] == sent[2].prompt)
    out_file = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "10", "--random-input-len", "24",
               "--random-output-len", "9", "--random-range-ratio", "0.3", "--max-concurrency", "2",
               "--seed", "3", "--disable-tqdm", "--output-file", str(out_file)])
    assert rc == 0
    printed = capsys.readouterr().out
    rows = _printed(printed)
    for name in METRIC_NAMES:
        assert name in rows, f"{name!r} not printed"
    assert rows["Successful requests"] == "9" and rows["Failed requests"] == "1"
    assert "HTTP 500" in printed and "stub failure" in printed
    assert "fewer tokens than max_tokens" not in printed  # the stub honours max_tokens exactly

    assert len(stub.bodies) == 11 and stub.max_active <= 2
    for body in stub.bodies:
        assert body["model"] == "stub-model" and body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}

    doc = json.loads(out_file.read_text())
    reqs = doc["requests"]
    assert len(reqs) == 10 and doc["config"]["max_concurrency"] == 2 and doc["model"] == "stub-model"
    assert [r["success"] for r in reqs] == [i != 2 for i in range(10)] and "HTTP 500" in reqs[2]["error"]
    by_prompt = {b["prompt"]: b for b in stub.bodies}
    assert set(by_prompt) == {q.prompt for q in sent}
    ok = [r for r in reqs if r["success"]]
    for r, q in zip(reqs, sent, strict=True):
        body = by_prompt[q.prompt]
        assert r["requested_output_len"] == q.output_len == body["max_tokens"]
        if not r["success"]:
            continue
        assert r["output_len"] == q.output_len
        assert r["prompt_len"] == 1000 + len(body["prompt"])  # the server's usage, not our tokenizer
        assert len(r["itl"]) == len(_chunk_sizes(body["max_tokens"])) - 1  # one gap per chunk
        assert 0 < r["ttft"] <= r["e2e"]
    m = doc["metrics"]
    assert m["completed"] == 9 and m["failed"] == 1
    assert m["total_output"] == sum(r["output_len"] for r in ok) == int(rows["Total generated tokens"])
    assert m["total_input"] == sum(r["prompt_len"] for r in ok) == int(rows["Total input tokens"])
    assert m["concurrency"] == pytest.approx(sum(r["e2e"] for r in ok) / m["duration_s"])
    assert 0 < m["concurrency"] <= 2.0 + 1e-9  # never more in flight than the cap


def test_cli_chat_backend_counts_text_without_usage(stub_server, tmp_path, capsys, tok):
    stub, url = stub_server()
    out_file = tmp_path / "chat.json"
    rc = main(["bench", "serve", "--base-url", url, "--backend", "openai-chat", "--model", "m",
               "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "5",
               "--random-range-ratio", "1", "--warmup-requests", "0", "--disable-tqdm",
               "--output-file", str(out_file)])
    assert rc == 0
    assert all(b["messages"][0]["role"] == "user" and b["model"] == "m" for b in stub.bodies)
    reqs = json.loads(out_file.read_text())["requests"]
    expected = len(tok.encode(" tok" * 5, add_special_tokens=False))
    assert [r["output_len"] for r in reqs] == [expected] * 3
    assert [r["prompt_len"] for r in reqs] == [8] * 3  # no usage: our own count of the prompt
    capsys.readouterr()


def test_cli_all_failed_warmup_and_bad_flags(stub_server, capsys, tok):
    _, url = stub_server(fail=lambda body: True)
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "2", "--random-input-len", "4",
                 "--random-output-len", "2", "--disable-tqdm"]) == 1
    assert "warmup" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", url, "--max-concurrency", "0"]) == 2
    assert "max_concurrency" in capsys.readouterr().err


def test_cli_warns_when_outputs_stop_short_of_max_tokens(stub_server, capsys, tok):
    _, url = stub_server(short=True)
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "2", "--random-input-len", "4",
                 "--random-output-len", "4", "--random-range-ratio", "1", "--disable-tqdm"]) == 0
    out = capsys.readouterr().out
    assert "warning: 2 of 2 requests got fewer tokens than max_tokens" in out
    assert _printed(out)["Total generated tokens"] == "6"


# ---------------------------------------------------------------- SSE framing of the client

def _payloads(stream: bytes, cuts: list[int]) -> list[bytes]:
    """The `data:` payloads the client's framing hands on when `stream` arrives cut at `cuts`."""
    got: list[bytes] = []
    ex = _Exchange(lambda payload, now: got.append(payload) and False, asyncio.Future(loop=asyncio.new_event_loop()))
    for a, b in zip([0] + cuts, cuts + [len(stream)]):
        ex.feed_events(stream[a:b], 0.0)
    if ex.tail:
        ex.feed_events(b"\n", 0.0)  # what the end of the body does with a last unterminated line
    return got


def test_sse_lines_survive_any_cut_and_any_line_end():
    stream = (b'data: {"a": 1}\n\n: a comment\r\n\r\ndata:{"b": 2}\r\n\r\nevent: x\rdata: {"c": 3}\r\r'
              b'data: [DONE]')
    want = [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}', b"[DONE]"]
    assert _payloads(stream, []) == want
    for cut in range(1, len(stream)):  # one cut anywhere, a CRLF split across reads included
        assert _payloads(stream, [cut]) == want, cut
    assert _payloads(stream, list(range(1, len(stream)))) == want  # a byte per read


# ---------------------------------------------------------------- splitting and merging client processes

def test_split_divides_requests_concurrency_and_rate():
    shares = split(10, Load(max_concurrency=5, request_rate=4.0, seed=7), 2)
    assert [idx for idx, _ in shares] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert [s for _, s in shares] == [Load(3, 2.0, 7), Load(2, 2.0, 8)]
    assert [s.max_concurrency for _, s in split(4, Load(None, float("inf"), 0), 3)] == [None] * 3
    with pytest.raises(ValueError, match="max_concurrency"):
        split(10, Load(1, 1.0, 0), 2)
    with pytest.raises(ValueError, match="more than the 1 requests"):
        split(1, Load(None, 1.0, 0), 2)


def test_merge_puts_records_back_in_request_order_over_the_union_window():
    def rec(i: int) -> RequestResult:
        return RequestResult(success=True, prompt_len=i, output_len=2, ttft=0.1, latency=0.5, itl=[0.4])

    first = LoadRun([rec(0), rec(2), rec(4)], start=10.0, end=13.0, cpu_s=1.5)
    second = LoadRun([rec(1), rec(3)], start=10.5, end=14.0, cpu_s=1.0)
    results, duration, cpu = merge([[0, 2, 4], [1, 3]], [first, second])
    assert [r.prompt_len for r in results] == [0, 1, 2, 3, 4]
    assert duration == pytest.approx(4.0)  # 10.0 (first start) to 14.0 (last end), not either window
    assert cpu == [(1.5, 3.0), (1.0, 3.5)]
    with pytest.raises(ValueError, match="cover"):
        merge([[0, 2, 4], [1, 1]], [first, second])


# ---------------------------------------------------------------- the fake server, for real

@pytest.fixture(scope="module")
def fake_server():
    """`fake_server.py --port 0 --workers 2` in a subprocess; its first line says where it listens."""
    proc = subprocess.Popen([sys.executable, fake_server_module.__file__, "--port", "0", "--workers", "2"],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # printed once both workers listen
    match = re.search(r"http://[\d.]+:\d+", line)
    assert match, f"fake server did not start: {line!r}"
    yield match.group(0)
    proc.terminate()  # the second worker ends when the first one's lifeline pipe closes
    proc.wait(timeout=10)


def _get(url: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """One request on a fresh connection, through the standard library's HTTP client (not ours)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.request("POST" if body is not None else "GET", path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _events(raw: bytes) -> list:
    lines = [line for line in raw.decode().split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def test_fake_server_streams_one_token_per_event_like_ketch_serve(fake_server):
    status, raw = _get(fake_server, "/v1/completions", {"prompt": "héllo", "max_tokens": 5, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    assert status == 200
    ev = _events(raw)
    assert ev[-1] == "[DONE]"
    tokens, usage = ev[:-2], ev[-2]
    assert [e["choices"][0]["text"] for e in tokens] == [" tok"] * 5
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * 4 + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["prompt_tokens"] == len("héllo".encode())  # no tokenizer: UTF-8 bytes

    status, raw = _get(fake_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 3, "stream": True})
    ev = _events(raw)
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"] for e in ev[1:4]] == [{"content": " tok"}] * 3
    assert ev[4]["choices"][0]["finish_reason"] == "length" and ev[5] == "[DONE]"  # no usage unless asked
    assert all("usage" not in e for e in ev[:5])

    status, raw = _get(fake_server, "/v1/completions", {"prompt": "x", "max_tokens": 4})
    whole = json.loads(raw)
    assert whole["choices"][0]["text"] == " tok" * 4 and whole["usage"]["completion_tokens"] == 4
    assert _get(fake_server, "/v1/completions", {"prompt": "x", "max_tokens": 0})[0] == 400
    assert _get(fake_server, "/v1/nothing")[0] == 404
    assert json.loads(_get(fake_server, "/v1/models")[1])["data"][0]["id"] == "fake-model"


def test_fake_server_workers_share_the_port(fake_server):
    # each worker names its answers by its pid; 16 fresh connections all on one of two sockets: p = 2**-15
    pids = {json.loads(_get(fake_server, "/v1/completions", {"prompt": "x", "max_tokens": 1})[1])["id"].split("-")[2]
            for _ in range(16)}
    assert len(pids) == 2


@pytest.mark.parametrize("processes", [1, 2])
def test_cli_against_fake_server(fake_server, processes, tmp_path, capsys, tok):
    n, out_len = 24, 16
    sent = random_requests(tok, n, 12, out_len, 0.5, seed=5)
    out_file = tmp_path / "fake.json"
    rc = main(["bench", "serve", "--base-url", fake_server, "--num-prompts", str(n), "--random-input-len", "12",
               "--random-output-len", str(out_len), "--random-range-ratio", "0.5", "--seed", "5",
               "--max-concurrency", "6", "--num-client-processes", str(processes), "--disable-tqdm",
               "--output-file", str(out_file)])
    assert rc == 0
    rows = _printed(capsys.readouterr().out)
    doc = json.loads(out_file.read_text())
    m, reqs = doc["metrics"], doc["requests"]
    assert m["completed"] == n and m["failed"] == 0 and int(rows["Successful requests"]) == n
    assert m["total_output"] == sum(q.output_len for q in sent) == int(rows["Total generated tokens"])
    # request order survives the merge: each record carries its own prompt's count (the fake's: UTF-8 bytes)
    assert len({len(q.prompt.encode()) for q in sent}) > 1
    assert [r["prompt_len"] for r in reqs] == [len(q.prompt.encode()) for q in sent]
    assert [r["output_len"] for r in reqs] == [r["requested_output_len"] for r in reqs] == [q.output_len for q in sent]
    assert all(len(r["itl"]) == r["output_len"] - 1 for r in reqs)  # one event per token
    # the metrics are those of the pooled records over one window
    e2e = [r["e2e"] for r in reqs]
    assert m["duration_s"] >= max(e2e)
    assert m["concurrency"] == pytest.approx(sum(e2e) / m["duration_s"]) and m["concurrency"] <= 6 + 1e-9
    assert m["mean_ttft_ms"] == pytest.approx(1000 * sum(r["ttft"] for r in reqs) / n)
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_len"] - 1) for r in reqs]
    assert m["mean_tpot_ms"] == pytest.approx(1000 * sum(tpot) / n)
    assert len(m["client"]["busy"]) == processes
    assert m["engine"] is None  # no ketch step clock behind the fake server


def test_cli_counts_text_after_the_run_when_the_server_reports_no_usage(fake_server, tmp_path, capsys, tok):
    out_file = tmp_path / "nousage.json"
    rc = main(["bench", "serve", "--base-url", fake_server, "--backend", "openai-chat", "--num-prompts", "4",
               "--random-input-len", "8", "--random-output-len", "7", "--random-range-ratio", "1",
               "--num-client-processes", "2", "--extra-request-body", '{"stream_options": {"include_usage": false}}',
               "--disable-tqdm", "--output-file", str(out_file)])
    assert rc == 0
    reqs = json.loads(out_file.read_text())["requests"]
    assert [r["output_len"] for r in reqs] == [len(tok.encode(" tok" * 7, add_special_tokens=False))] * 4 == [7] * 4
    assert [r["prompt_len"] for r in reqs] == [8] * 4  # no usage: our own count of the prompt
    capsys.readouterr()


def test_cli_rejects_more_client_processes_than_concurrency(capsys):
    assert main(["bench", "serve", "--num-client-processes", "3", "--max-concurrency", "2"]) == 2
    assert "num_client_processes" in capsys.readouterr().err
