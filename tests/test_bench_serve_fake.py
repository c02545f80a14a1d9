"""`ketch bench serve` against the fake server (ketch/bench/fake_server.py), started for real in a
subprocess: its streams, its workers sharing a port, and CLI runs with one and two client processes."""
from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
from urllib.parse import urlsplit

import pytest
from bench_util import printed as _printed
from bench_util import shared_tokenizer, tok  # noqa: F401  (fixtures)

from ketch.bench import fake_server as fake_server_module
from ketch.bench.datasets import random_requests
from ketch.cli import main


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
