"""`ketch bench serve` run by the CLI against a deterministic stub OpenAI server in a thread: the
printed metrics, the requests it sends, the result file, failures, and short outputs; multi-turn
conversations (what each round sends, a failed round, --flush-cache's place and its refusal);
groups sharing a system prompt and the cache hit rate read from the usage."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from typing import Callable

import pytest
import uvicorn
from bench_util import printed as _printed
from bench_util import shared_tokenizer, tok  # noqa: F401  (fixtures)
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ketch.bench.datasets import random_requests, random_turns, shared_prefix_requests
from ketch.cli import main

METRIC_NAMES = [
    "Successful requests", "Benchmark duration (s)", "Total input tokens", "Total generated tokens",
    "Request throughput (req/s)", "Input token throughput (tok/s)", "Output token throughput (tok/s)",
    "Total token throughput (tok/s)", "Concurrency", "Mean E2E Latency (ms)", "Median E2E Latency (ms)",
    "P99 E2E Latency (ms)", "Mean TTFT (ms)", "Median TTFT (ms)", "P99 TTFT (ms)", "Mean TPOT (ms)",
    "Median TPOT (ms)", "P99 TPOT (ms)", "Mean ITL (ms)", "Median ITL (ms)", "P95 ITL (ms)", "P99 ITL (ms)",
    "Max ITL (ms)",
]


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

    def __init__(self, fail: Callable[[dict], bool], short: bool = False, flush: bool = False,
                 cache: bool = False) -> None:
        self.fail = fail
        self.short = short  # stop one token early, like a server that ignores ignore_eos
        # completions: report cached_tokens = the longest common prefix (in characters) with an earlier prompt
        self.cache = cache
        self.bodies: list[dict] = []
        self.flushed_after: list[int] = []  # bodies received when each POST /flush_cache came
        self.active = self.max_active = 0
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.chat)
        if flush:
            self.app.post("/flush_cache")(self.flush)

    async def flush(self) -> dict:
        self.flushed_after.append(len(self.bodies))
        return {"object": "flush_cache", "freed_pages": 7, "freed_host_pages": 0}

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
        if self.cache and not chat:
            usage["prompt_tokens_details"] = {"cached_tokens": max(
                (_common_prefix(body["prompt"], b["prompt"]) for b in self.bodies[:-1]), default=0)}

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


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture
def stub_server():
    servers = []

    def start(fail: Callable[[dict], bool] = lambda body: False, short: bool = False,
              flush: bool = False, cache: bool = False) -> tuple[Stub, str]:
        stub = Stub(fail, short, flush, cache)
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


MULTITURN = ["--dataset-name", "multiturn", "--multiturn-clients", "2", "--multiturn-rounds", "3",
             "--multiturn-turn-len", "6", "--random-output-len", "3", "--seed", "5", "--disable-tqdm"]


def test_multiturn_sends_each_history_and_stops_a_conversation_at_a_failed_round(stub_server, tmp_path, capsys, tok):
    turns = random_turns(tok, 2, 3, 6, seed=5)
    stub, url = stub_server(fail=lambda body: body["prompt"].endswith(turns[1][1]), flush=True)  # client 1, round 2
    out_file = tmp_path / "multiturn.json"
    assert main(["bench", "serve", "--base-url", url, *MULTITURN, "--flush-cache", "--output-file", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert stub.flushed_after == [1] and "7 device pages freed" in out  # after the one warmup request, before the run
    prompts = [b["prompt"] for b in stub.bodies[1:]]
    assert all(b["max_tokens"] == 3 and b["ignore_eos"] is True for b in stub.bodies)
    answer = " tok" * 3  # what the stub answers
    want = [turns[0][0], turns[0][0] + answer + "\n\n" + turns[0][1],
            turns[0][0] + answer + "\n\n" + turns[0][1] + answer + "\n\n" + turns[0][2],
            turns[1][0], turns[1][0] + answer + "\n\n" + turns[1][1]]  # client 1's round 3 is never sent
    assert sorted(prompts) == sorted(want)
    doc = json.loads(out_file.read_text())
    reqs = doc["requests"]
    assert [(r["client"], r["round"], r["success"]) for r in reqs] == [
        (0, 1, True), (0, 2, True), (0, 3, True), (1, 1, True), (1, 2, False), (1, 3, False)]
    assert "HTTP 500" in reqs[4]["error"] and reqs[5]["error"] == "not sent: round 2 failed"
    mt = doc["metrics"]["multiturn"]
    assert [(r["completed"], r["failed"]) for r in mt["per_round"]] == [(2, 0), (1, 1), (1, 1)]
    assert all(r["cache_hit_rate"] is None for r in mt["per_round"])  # the stub reports no cached tokens
    assert mt["cache_hit_rate_rounds_2plus"] is None
    assert mt["mean_ttft_ms_rounds_2plus"] == pytest.approx(1000 * (reqs[1]["ttft"] + reqs[2]["ttft"]) / 2)
    rows = _printed(out)
    assert rows["Round 2 requests (ok / failed)"] == "1 / 1" and rows["Clients x rounds"] == "2 x 3"
    assert rows["Round 1 cache hit rate"].startswith("n/a")


def test_multiturn_chat_sends_the_conversation_as_messages(stub_server, tmp_path, capsys, tok):
    turns = random_turns(tok, 2, 3, 6, seed=5)
    stub, url = stub_server()
    out_file = tmp_path / "chat.json"
    assert main(["bench", "serve", "--base-url", url, *MULTITURN, "--backend", "openai-chat",
                 "--warmup-requests", "0", "--output-file", str(out_file)]) == 0
    answer = " tok" * 3
    last = [b["messages"] for b in stub.bodies if len(b["messages"]) == 5]
    assert sorted(m[-1]["content"] for m in last) == sorted(t[2] for t in turns)
    for messages in last:
        c = [t[2] for t in turns].index(messages[-1]["content"])
        assert messages == [{"role": "user", "content": turns[c][0]}, {"role": "assistant", "content": answer},
                            {"role": "user", "content": turns[c][1]}, {"role": "assistant", "content": answer},
                            {"role": "user", "content": turns[c][2]}]
    reqs = json.loads(out_file.read_text())["requests"]
    # no usage from the chat route: the prompt counted by our tokenizer over the messages' contents
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    assert [r["prompt_len"] for r in reqs[:3]] == [count(turns[0][0]), count(turns[0][0] + answer + turns[0][1]),
                                                  count(turns[0][0] + answer + turns[0][1] + answer + turns[0][2])]
    capsys.readouterr()


def test_multiturn_refusals(stub_server, capsys, tok):
    _, url = stub_server()  # no /flush_cache here
    assert main(["bench", "serve", "--base-url", url, *MULTITURN, "--flush-cache"]) == 1
    err = capsys.readouterr().err
    assert "flush_cache" in err and "HTTP 404" in err
    assert main(["bench", "serve", "--base-url", url, *MULTITURN, "--num-client-processes", "2"]) == 2
    assert "num_client_processes: --dataset-name multiturn runs on one client process" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", url, *MULTITURN, "--request-rate", "4"]) == 2
    assert "request_rate: " in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", url, *MULTITURN, "--multiturn-rounds", "0"]) == 2
    assert "multiturn_rounds: must be >= 1" in capsys.readouterr().err


def test_shared_prefix_dataset_sends_the_groups_and_reports_the_hit_rate(stub_server, tmp_path, capsys, tok):
    want = shared_prefix_requests(tok, 3, 4, 20, 6, 3, seed=4)
    stub, url = stub_server(cache=True)
    out_file = tmp_path / "gsp.json"
    assert main(["bench", "serve", "--base-url", url, "--dataset-name", "generated-shared-prefix",
                 "--gsp-num-groups", "3", "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "20",
                 "--gsp-question-len", "6", "--gsp-output-len", "3", "--seed", "4", "--max-concurrency", "1",
                 "--num-prompts", "2", "--disable-tqdm", "--output-file", str(out_file)]) == 0
    out = capsys.readouterr().out
    # the warmup first (a question-length prompt of no group), then every request once in the dataset's order
    # (one at a time here, so in that order); --num-prompts does not apply
    assert [b["prompt"] for b in stub.bodies[1:]] == [q.prompt for q in want]
    assert not any(stub.bodies[0]["prompt"].startswith(q.prompt[:20]) for q in want)
    assert all(b["max_tokens"] == 3 and b["ignore_eos"] is True for b in stub.bodies)
    doc = json.loads(out_file.read_text())
    reqs, m = doc["requests"], doc["metrics"]
    assert [r["group"] for r in reqs] == [q.group for q in want]
    # cached / prompt tokens summed over the run, as the stub reported them per request
    assert all(isinstance(r["cached_tokens"], int) for r in reqs)
    assert m["total_cached"] == sum(r["cached_tokens"] for r in reqs)
    assert m["cache_hit_rate"] == pytest.approx(m["total_cached"] / sum(r["prompt_len"] for r in reqs))
    # every group's later requests share at least its system prompt's text with the group's first one
    for g in range(3):
        group = [q.prompt for q in want if q.group == g]
        system = os.path.commonprefix(group)
        later = [r for r in reqs if r["group"] == g][1:]
        assert len(later) == 3 and all(r["cached_tokens"] >= len(system) > 20 for r in later)
    assert _printed(out)["Cache hit rate"] == f"{100 * m['cache_hit_rate']:.2f}% ({m['total_cached']} prompt tokens cached)"
