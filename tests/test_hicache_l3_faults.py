"""The storage tier (L3) under faults, through the engine: a flipped byte, a truncated page, a
page of another model and two pages swapped between their keys are each refused, counted, recomputed, and the answer is the cold run's; a
dead or hung Redis costs hits, never requests; a full write queue and a store that cannot write
drop writes and count them; bad L3 options are refused naming the field. (test_hicache_l3.py:
the workloads with L3 working.)"""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import collect, drain, make_tiny_engine
from redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)
from server_util import wait_for
from test_hicache_l2 import DEVICE_PAGES, PARAMS, PS, multi_turn
from test_hicache_l3 import LONG, file_url, finish, l3_engine, reference  # noqa: F401  (reference: the fixture)

from ketch.cache.page_codec import encode_page
from ketch.cache.page_format import PageFormat
from ketch.cache.page_hash import ROOT_HASH, chain_hashes
from ketch.cache.storage.file import FileStorage
from ketch.config import EngineConfig
from ketch.engine.engine import Engine


# ---- integrity -----------------------------------------------------------------------------

def _page_file(eng: Engine, root: Path, tokens: list[int], index: int) -> Path:
    fmt = eng.kv.storage.format  # type: ignore[union-attr]
    hashes = chain_hashes(ROOT_HASH, tokens[: (len(tokens) - 1) // PS * PS], PS)
    return FileStorage(root).path(fmt.key(hashes[index]))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _foreign(eng: Engine, path: Path) -> None:
    """The same key, but a page another model wrote (another fingerprint in its header)."""
    fmt: PageFormat = eng.kv.storage.format  # type: ignore[union-attr]
    other = PageFormat(**{**fmt.__dict__, "fingerprint": "another-model"})
    path.write_bytes(encode_page(eng.kv.pool.layers, 0, other, key=path.name))  # a file's name is its key


def _swap(path: Path, other: Path) -> None:
    """Two intact pages of ours, each in the other's file: the KV of other tokens under the key."""
    a, b = path.read_bytes(), other.read_bytes()
    path.write_bytes(b)
    other.write_bytes(a)


@pytest.mark.parametrize("damage,reason", [("flip", "corrupt"), ("truncate", "corrupt"), ("foreign", "foreign"),
                                           ("swap", "corrupt")])
def test_a_damaged_or_foreign_page_is_refused_counted_and_recomputed(tiny_config_path: str, tmp_path: Path,
                                                                     damage: str, reason: str) -> None:
    root = tmp_path / "kv"
    first = l3_engine(tiny_config_path, file_url(root))
    first.add_request("turn1", LONG, PARAMS)
    drain(first)
    finish(first)
    query = LONG + [11, 12, 13, 14]
    bad = 6  # pages 0-5 are fine; 6 and everything after it (its descendants) must be recomputed
    second = l3_engine(tiny_config_path, file_url(root))
    path = _page_file(second, root, query, bad)
    {"flip": _flip, "truncate": _truncate, "foreign": lambda p: _foreign(second, p),
     "swap": lambda p: _swap(p, _page_file(second, root, query, bad + 1))}[damage](path)
    second.add_request("q", query, PARAMS)
    got = collect(drain(second))[("q", 0)]["ids"]
    s = second.stats()
    assert getattr(s, f"storage_rejected_{reason}") == 1
    assert s.storage_hit_tokens == bad * PS  # exactly the pages before the bad one
    cold = make_tiny_engine(tiny_config_path, kv_cache_memory=DEVICE_PAGES * 2048, page_size=PS)
    cold.add_request("q", query, PARAMS)
    assert got == collect(drain(cold))[("q", 0)]["ids"]
    finish(second)  # the recomputed page was written again, over the bad one:
    third = l3_engine(tiny_config_path, file_url(root))
    third.add_request("q", query, PARAMS)
    drain(third)
    assert third.stats().storage_rejected_corrupt + third.stats().storage_rejected_foreign == 0
    assert third.stats().storage_hit_tokens == (len(query) - 1) // PS * PS
    finish(third)


# ---- faults --------------------------------------------------------------------------------

def test_a_dead_then_restarted_redis_costs_hits_never_requests(tiny_config_path: str,
                                                               redis_server: RedisServer) -> None:
    eng = l3_engine(tiny_config_path, redis_server.url, backend="redis")
    eng.add_request("a", LONG, PARAMS)
    drain(eng)
    assert eng.kv.storage.drain(10.0)  # type: ignore[union-attr]
    redis_server.kill()
    eng.kv.flush()  # device and host empty: only storage could serve the prompt
    eng.add_request("b", LONG + [1, 2], PARAMS)
    out = collect(drain(eng))[("b", 0)]
    assert len(out["ids"]) == PARAMS.max_tokens and out["reason"] == "length"
    s = eng.stats()
    assert s.storage_hit_tokens == 0 and s.storage_errors > 0
    redis_server.restart()  # empty: what this engine writes now is what it can read back
    backend = eng.kv.storage.backend  # type: ignore[union-attr]
    wait_for(lambda: backend.set("probe", b"x"), "the backend to reconnect (after its cool-down)")
    eng.kv.flush()
    eng.add_request("c", LONG + [3, 4], PARAMS)
    drain(eng)
    assert eng.kv.storage.drain(10.0)  # type: ignore[union-attr]
    eng.kv.flush()
    eng.add_request("d", LONG + [3, 4], PARAMS)
    drain(eng)
    assert eng.stats().storage_hit_tokens > 0  # reconnected without a rebuild
    finish(eng)


def test_a_hung_store_lets_the_request_in_at_the_prefetch_deadline(tiny_config_path: str,
                                                                   redis_server: RedisServer) -> None:
    eng = l3_engine(tiny_config_path, redis_server.url, backend="redis", hicache_prefetch_timeout=0.05)
    redis_server.pause()  # connections accepted, nothing answers: the read hangs to its socket timeout
    try:
        eng.add_request("a", LONG, PARAMS)
        out = collect(drain(eng))[("a", 0)]
        assert len(out["ids"]) == PARAMS.max_tokens
        s = eng.stats()
        assert s.storage_prefetches == 1 and s.storage_prefetch_timeouts == 1
    finally:
        redis_server.resume()
    finish(eng)


def test_a_full_write_queue_drops_writes_and_counts_them(tiny_config_path: str, redis_server: RedisServer) -> None:
    eng = l3_engine(tiny_config_path, redis_server.url, backend="redis", hicache_storage_write_queue=1)
    redis_server.pause()  # the writer blocks on its first set: the queue of one fills
    try:
        eng.add_request("a", LONG, PARAMS)
        drain(eng)
        assert eng.stats().storage_dropped_writes > 0
    finally:
        redis_server.resume()
    finish(eng)


def test_a_file_store_that_cannot_write_drops_and_counts(tiny_config_path: str, reference, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the store's folder should be")
    eng = l3_engine(tiny_config_path, file_url(blocker / "kv"))
    assert multi_turn(eng) == reference
    s = eng.stats()
    assert s.storage_written_pages == 0 and s.storage_dropped_writes > 0 and s.storage_hit_tokens == 0
    finish(eng)


# ---- configuration -------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(hicache_prefetch_timeout=2.0), dict(hicache_storage_write_queue=8)])
def test_an_l3_option_without_a_backend_says_to_add_one(kw: dict) -> None:
    field = next(iter(kw))
    with pytest.raises(ValueError, match=f"^{field} .*--hicache-storage-backend"):
        EngineConfig(enable_hierarchical_cache=True, **kw)


@pytest.mark.parametrize("kw,field", [(dict(hicache_prefetch_timeout=-1.0), "hicache_prefetch_timeout"),
                                      (dict(hicache_storage_write_queue=0), "hicache_storage_write_queue")])
def test_bad_l3_values_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineConfig(enable_hierarchical_cache=True, hicache_storage_backend="file", **kw)

