"""`ketch serve` under load: many concurrent streaming clients, clients that drop mid-stream, and
the page accounting seen through /metrics afterwards (every KV page back: none held by a request,
free + cached == total, no reference beyond the cache's own: server_util.pages_all_back)."""
from __future__ import annotations

import asyncio
import json
import random

import openai
import pytest
from server_util import metrics, open_stream, pages_all_back, running_server, wait_for

CLIENTS = 64
REQUESTS = 320
SYSTEM = "You are a terse assistant. Answer in a few words. " * 4  # a shared prefix: cache hits under load


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running


def test_64_concurrent_streaming_clients_lose_nothing(server):
    _, base = server
    before = metrics(base)
    rng = random.Random(0)
    jobs = [(i, rng.choice([4, 8, 12]), rng.random() < 0.5) for i in range(REQUESTS)]

    async def one(client: openai.AsyncOpenAI, model: str, i: int, max_tokens: int, chat: bool) -> tuple[int, str]:
        if chat:
            stream = await client.chat.completions.create(
                model=model, max_tokens=max_tokens, temperature=0.7, seed=i, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Name a number near {i}."}])
            chunks = [c async for c in stream]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            stream = await client.completions.create(
                model=model, prompt=f"{SYSTEM}Request {i}:", max_tokens=max_tokens, temperature=0.7, seed=i,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            chunks = [c async for c in stream]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert finish == ["length"], (i, finish)
        assert usage is not None and usage.completion_tokens == max_tokens, (i, usage)
        return i, finish[0]

    async def main() -> list[tuple[int, str]]:
        gate = asyncio.Semaphore(CLIENTS)
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            model = (await client.models.list()).data[0].id

            async def gated(job):
                async with gate:
                    return await one(client, model, *job)

            return await asyncio.gather(*(gated(job) for job in jobs))

    done = asyncio.run(main())
    assert sorted(i for i, _ in done) == list(range(REQUESTS))  # none lost

    after = metrics(base)
    assert pages_all_back(after), after
    finished = after['ketch_requests_finished_total{finish_reason="length"}'] - before.get(
        'ketch_requests_finished_total{finish_reason="length"}', 0)
    assert finished == REQUESTS
    assert after["ketch_time_to_first_token_seconds_count"] - before["ketch_time_to_first_token_seconds_count"] == REQUESTS
    generated = sum(n for _, n, _ in jobs)
    assert after["ketch_generation_tokens_total"] - before["ketch_generation_tokens_total"] == generated
    assert after["ketch_inter_token_latency_seconds_count"] - before["ketch_inter_token_latency_seconds_count"] == (
        generated - REQUESTS)
    assert after["ketch_prefix_cache_hit_rate"] > 0.3  # the shared system prompt was served from the cache


def test_clients_that_disconnect_mid_stream_are_aborted_and_freed(server):
    _, base = server
    before = metrics(base)
    streams = [open_stream(base, path, body) for path, body in [
        ("/v1/completions", {"prompt": f"Once upon a time, story {i}", "max_tokens": 2000, "ignore_eos": True})
        for i in range(6)
    ] + [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Write a long essay number {i}."}],
                                  "max_tokens": 2000, "ignore_eos": True, "n": 2})
        for i in range(2)
    ]]
    mid = metrics(base)
    assert mid["ketch_num_requests_running"] + mid["ketch_num_requests_waiting"] == 10
    assert mid["ketch_kv_pages_used"] > 0
    for conn, _ in streams:
        conn.close()  # mid-stream: the server notices and aborts the samples in the engine
    wait_for(lambda: pages_all_back(metrics(base)), "the aborted requests' pages to return")
    after = metrics(base)
    aborted = after['ketch_requests_finished_total{finish_reason="abort"}'] - before.get(
        'ketch_requests_finished_total{finish_reason="abort"}', 0)
    assert aborted == 10
    # far fewer than 2000 tokens each were generated: the aborts took effect, the requests did not run on
    assert after["ketch_generation_tokens_total"] - before["ketch_generation_tokens_total"] < 10 * 200


def test_bench_serve_reads_the_engine_step_clock_of_its_own_run(server, tmp_path, capsys):
    """`ketch bench serve` reports the server's mean engine step over its run beside the TPOT it
    measured: the steps it counts are exactly the ones the run caused (read from /metrics after
    the warmup and at the end), and the mean is their wall time over their count."""
    from ketch.cli import main

    _, base = server
    before = metrics(base)
    out_file = tmp_path / "ketch.json"
    rc = main(["bench", "serve", "--base-url", base, "--num-prompts", "6", "--random-input-len", "8",
               "--random-output-len", "5", "--random-range-ratio", "1", "--max-concurrency", "3",
               "--warmup-requests", "0", "--disable-tqdm", "--output-file", str(out_file)])
    assert rc == 0
    after = metrics(base)
    engine = json.loads(out_file.read_text())["metrics"]["engine"]
    steps = after["ketch_engine_steps_total"] - before["ketch_engine_steps_total"]
    seconds = after["ketch_engine_step_seconds_total"] - before["ketch_engine_step_seconds_total"]
    assert steps >= 5 and engine["steps"] == steps  # five tokens each take at least five steps
    assert engine["mean_step_ms"] == pytest.approx(1000 * seconds / steps)
    # the engine-side TPOT: six requests of exactly five tokens finished, four intervals each
    intervals = after["ketch_engine_decode_intervals_total"] - before["ketch_engine_decode_intervals_total"]
    decode = after["ketch_engine_decode_seconds_total"] - before["ketch_engine_decode_seconds_total"]
    assert intervals == 6 * 4
    assert engine["decode_tpot_ms"] == pytest.approx(1000 * decode / intervals)
    assert engine["median_tpot_over_median_decode_tpot"] == pytest.approx(
        json.loads(out_file.read_text())["metrics"]["median_tpot_ms"] / engine["median_decode_tpot_ms"])
    printed = capsys.readouterr().out
    assert f"Engine steps during the run (server /metrics): {int(steps)}" in printed
    assert "median TPOT / engine-side median TPOT = " in printed
    # the median: of the six requests the run added to the per-request histogram
    le = "ketch_engine_request_tpot_seconds_bucket"
    bounds = sorted((float(k.split('le="')[1].rstrip('"}')), after[k] - before.get(k, 0))
                    for k in after if k.startswith(le))
    assert bounds[-1] == (float("inf"), 6)
    occupied = [i for i, (b, n) in enumerate(bounds) if n > (bounds[i - 1][1] if i else 0)]
    low = bounds[occupied[0] - 1][0] if occupied[0] else 0.0
    assert 1000 * low <= engine["median_decode_tpot_ms"] <= 1000 * bounds[occupied[-1]][0]
