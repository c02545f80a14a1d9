"""Mid-stream failover through `ketch gateway` (issue 16, item 4), for real: 200 streams (greedy and
seeded, chat and completions, the openai SDK as the client) in flight over 3 `ketch serve`
replicas; the replica with the most streams is SIGKILLed mid-run. Every stream must end as one
unbroken stream (no error, one id) whose text and usage equal the same request's on a single
healthy server; the dead worker is taken out and, restarted on its port, used again."""
from __future__ import annotations

import asyncio

import openai
import pytest
from gateway_util import MODEL, replicas, request, running_gateway, sigkill_replica, start_replica, stop, wait_healthy, workers
from server_util import parse_metrics, wait_for

N = 200
KILL_AFTER = 12  # streams of one worker with text out when it is killed: mid-run, mid-stream
PROMPTS = ["Once upon a time", "The capital of France is", "List three colours:", "Write a haiku about rain.",
           "def fibonacci(n):", "Explain what a CPU does.", "The best way to learn is", "Name a large animal.",
           "Translate 'thank you' into French.", "Why is the sky blue?"]


def requests() -> list[tuple[str, dict]]:
    """Half chat, half completions; half greedy, half seeded (temperature 0.8); 16–48 tokens."""
    out = []
    for i in range(N):
        sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i} if (i // 2) % 2 else {"temperature": 0}
        body = {"model": MODEL, "max_tokens": 16 + (i % 5) * 8, "stream_options": {"include_usage": True}, **sampling}
        if i % 2:
            out.append(("chat", {**body, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}))
        else:
            out.append(("completions", {**body, "prompt": PROMPTS[i % len(PROMPTS)], "extra_body": {"ignore_eos": True}}))
    return out


async def one_stream(client: openai.AsyncOpenAI, route: str, body: dict,
                     streaming: dict[str, asyncio.Future]) -> tuple[str, dict, set[str]]:
    """The stream's text, usage and chunk ids, as the SDK hands them over. `streaming[url]` counts
    the streams whose first text that worker sent (x-ketch-worker); the first to reach KILL_AFTER
    is the victim."""
    create = client.chat.completions if route == "chat" else client.completions
    raw = await create.with_raw_response.create(stream=True, **body)
    worker, stream = raw.headers.get("x-ketch-worker"), raw.parse()  # None: straight to a server
    text, usage, ids = [], None, set()
    async for chunk in stream:
        ids.add(chunk.id)
        for c in chunk.choices:
            had_text = any(text)
            text.append((c.delta.content or "") if route == "chat" else c.text)
            if not had_text and any(text) and "victim" in streaming:  # its first token (not a role chunk)
                streaming[worker] = streaming.get(worker, 0) + 1
                if streaming[worker] == KILL_AFTER and not streaming["victim"].done():
                    streaming["victim"].set_result(worker)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
    return "".join(text), usage, ids


async def run_all(base: str, kill=None) -> list[tuple[str, dict, set[str]]]:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)
    streaming: dict = {"victim": asyncio.get_running_loop().create_future()} if kill else {}
    gathered = asyncio.gather(*(one_stream(client, route, body, streaming) for route, body in requests()))
    try:
        if kill is not None:
            await asyncio.wait([streaming["victim"], gathered], return_when=asyncio.FIRST_COMPLETED)
            if gathered.done():
                gathered.result()  # a stream's error, if that is why they all ended
                raise AssertionError(f"every stream ended before one worker had {KILL_AFTER} going")
            await asyncio.to_thread(kill, streaming["victim"].result())
        return await gathered
    finally:
        await client.close()


@pytest.fixture(scope="module")
def cluster():
    with replicas(3) as rs:
        with running_gateway("--worker-urls", *(r.url for r in rs), "--policy", "round_robin",
                             "--cb-failure-threshold", "3", "--cb-success-threshold", "1",
                             "--cb-timeout-duration-secs", "2", "--health-check-interval-secs", "0.5",
                             "--health-failure-threshold", "2", "--health-success-threshold", "1") as (_, base):
            yield base, rs


def test_a_replica_sigkilled_mid_run_loses_no_stream(cluster):
    base, rs = cluster
    victim = []

    def kill(url: str) -> None:
        replica = next(r for r in rs if r.url == url)
        victim.append((replica, workers(base)[url]["in_flight"]))
        sigkill_replica(replica)

    through_gateway = asyncio.run(run_all(base, kill))
    (dead, in_flight_at_kill), = victim
    survivor = next(r for r in rs if r is not dead)
    reference = asyncio.run(run_all(survivor.url))
    for i, ((text, usage, ids), (ref_text, ref_usage, _)) in enumerate(zip(through_gateway, reference)):
        assert len(ids) == 1, (i, ids)  # one stream, as the client sees it
        assert (text, usage) == (ref_text, ref_usage), i
    m = parse_metrics(request(base, "GET", "/metrics")[2].decode())
    cut = m.get(f'ketch_gateway_worker_errors_total{{kind="stream_cut",worker="{dead.url}"}}', 0)
    assert in_flight_at_kill >= KILL_AFTER and cut >= KILL_AFTER, (in_flight_at_kill, cut)  # it cut streams
    assert m['ketch_gateway_failovers_total{outcome="resumed"}'] == cut
    assert m["ketch_gateway_failover_tokens_total"] >= KILL_AFTER  # they went on from tokens the client had
    assert m.get('ketch_gateway_failovers_total{outcome="gave_up"}', 0) == 0
    # the dead worker is out; restarted on its port it comes back
    assert not workers(base)[dead.url]["available"]
    revived = start_replica(dead.port)
    try:
        wait_healthy(revived)
        wait_for(lambda: workers(base)[dead.url]["available"], "the revived worker to be available", 30)
        served = {request(base, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})[1]
                  ["x-ketch-worker"] for _ in range(6)}
        assert dead.url in served
    finally:
        stop(revived.proc)
