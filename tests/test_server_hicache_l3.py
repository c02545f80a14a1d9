"""The storage tier (L3) through `ketch serve` on the bundled SmolLM2: a restarted server serves an
old conversation's prefix from a file store and from a real redis-server (visible in
usage.prompt_tokens_details.cached_tokens), and a Redis killed mid-run costs cache hits, never a
request: every answer is a 200, the failures are counted in /metrics, and the tier comes back
when Redis does."""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_server import SKIP_REASON, RedisServer
from server_util import metrics, post, running_server, wait_for

PAGE = 16  # the CPU default page size
TOPIC = ("Write a careful, detailed summary of the history of lighthouses, their keepers, the lenses "
         "they used, and how ships found their way along dark and stormy coasts before radio. ")


def l3_flags(backend: str, url: str) -> list[str]:
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", backend, "--hicache-storage-url", url]


def chat(base: str, messages: list[dict], max_tokens: int = 16) -> dict:
    status, body = post(base, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                       "temperature": 0})
    assert status == 200, body
    return body


def written(base: str) -> float:
    return metrics(base).get("ketch_hicache_storage_written_pages_total", 0)


@pytest.fixture
def big_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """Room for a conversation: SmolLM2's fp32 pages are 737 KB each (the shared fixture's 4 MB
    Redis would evict the first pages of the prefix before the restart, by design of an LRU store)."""
    if shutil.which("redis-server") is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path, maxmemory="256mb")
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_a_restarted_server_serves_an_old_conversation_from_storage(backend: str, tmp_path: Path,
                                                                    request: pytest.FixtureRequest) -> None:
    url = f"file://{tmp_path / 'kv'}" if backend == "file" else request.getfixturevalue("big_redis").url
    first_turn = [{"role": "user", "content": TOPIC * 4}]
    with running_server(*l3_flags(backend, url)) as (_, base):
        one = chat(base, first_turn)
        prompt = one["usage"]["prompt_tokens"]
        wait_for(lambda: written(base) >= prompt // PAGE, "the first turn's pages to reach storage")
    prefix = prompt + one["usage"]["completion_tokens"]
    second_turn = first_turn + [{"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                                {"role": "user", "content": "Now in one sentence."}]
    with running_server(*l3_flags(backend, url)) as (_, base):
        two = chat(base, second_turn)
        cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.9 * prefix, (cached, prefix)
        assert metrics(base)['ketch_cache_hit_tokens_total{tier="storage"}'] == cached


def test_a_killed_redis_costs_hits_never_requests(big_redis: RedisServer) -> None:
    ask = [{"role": "user", "content": TOPIC * 2}]
    with running_server(*l3_flags("redis", big_redis.url)) as (_, base):
        chat(base, ask)
        wait_for(lambda: written(base) > 0, "pages to reach Redis")
        big_redis.kill()
        for i in range(3):  # the device and host tiers flushed: only Redis could serve these
            assert post(base, "/flush_cache", {})[0] == 200
            chat(base, ask + [{"role": "user", "content": f"Again, {i}."}])
        m = metrics(base)
        assert m["ketch_hicache_storage_errors_total"] > 0
        assert m['ketch_cache_hit_tokens_total{tier="storage"}'] == 0
        big_redis.restart()  # empty, on the same port

        def served_from_redis() -> bool:
            assert post(base, "/flush_cache", {})[0] == 200
            chat(base, ask)  # written again once the backend reconnects, read back the next time
            return metrics(base)['ketch_cache_hit_tokens_total{tier="storage"}'] > 0

        wait_for(served_from_redis, "the tier to come back with Redis")
