"""The L3 Redis backend against a real redis-server (tests/redis_server.py): round trips, the key
namespace, exists_prefix over a hole, LRU eviction under a small maxmemory, and faults: a killed
server (misses, dropped writes, counted, each call bounded in time, then a reconnect on restart
without rebuilding the backend) and a hung one (one timeout per cool-down, not one per call).
URL checks need no server."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import redis.connection

from ketch.cache.storage import StorageBackend, open_backend
from ketch.cache.storage.redis_storage import DEFAULT_URL, NAMESPACE, RedisStorage, parse_url
from redis_server import RedisServer, free_port, redis_server  # noqa: F401  (a fixture: used by name)

T = TypeVar("T")
TIMEOUT_S = 0.5
# one request: at most a connect and a reply, each up to the timeout; the rest is slack for a
# loaded 2-core CI machine
CALL_BOUND_S = 2 * TIMEOUT_S + 1.0
DEADLINE_S = 10.0


def keys(n: int) -> list[str]:
    return [f"{i:02x}page{i}" for i in range(n)]


def timed(call: Callable[[], T]) -> tuple[T, float]:
    """`call()` and how long it took; it runs in a thread, so a call that never returns (a socket
    without a timeout on a hung server) fails the test at CALL_BOUND_S instead of hanging it. An
    exception of the call is raised here."""
    out: list[T] = []
    raised: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as e:  # handed to the test's thread
            raised.append(e)

    worker = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    worker.start()
    worker.join(CALL_BOUND_S)
    took = time.monotonic() - start
    if raised:
        raise raised[0]
    assert out, f"the call did not return within {CALL_BOUND_S} s"
    return out[0], took


def poll(ok: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not ok():
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE_S} s"
        time.sleep(0.05)  # the interval between polls; the deadline is what bounds the wait


def test_round_trip_misses_and_counters(redis_server: RedisServer) -> None:
    store = RedisStorage(redis_server.url)
    assert isinstance(store, StorageBackend)
    assert store.get("abc") is None and not store.exists("abc")
    assert store.set("abc", b"\x00\x01payload\xff")
    assert store.exists("abc") and store.get("abc") == b"\x00\x01payload\xff"
    assert store.set("abc", b"new")  # overwrite replaces
    assert store.get("abc") == b"new"
    big = bytes(range(256)) * 4096  # 1 MiB: a real page's size class
    assert store.set("big", big) and store.get("big") == big
    s = store.stats
    assert (s.gets, s.hits, s.sets, s.dropped_writes, s.read_errors, s.errors) == (4, 3, 3, 0, 0, 0)
    assert s.written_bytes == s.read_bytes == len(b"\x00\x01payload\xff") + 3 + len(big)


def test_keys_live_under_the_namespace(redis_server: RedisServer) -> None:
    raw = redis_server.raw()
    store = RedisStorage(redis_server.url)
    store.set("abc", b"v")
    assert raw.keys("*") == [NAMESPACE.encode() + b"abc"] and raw.get("ketch:kv:abc") == b"v"
    raw.set("xyz", b"someone else's")  # another program's key in the same Redis
    assert store.get("xyz") is None and not store.exists("xyz")
    other = RedisStorage(redis_server.url, namespace="other:")
    assert other.get("abc") is None and other.set("abc", b"w")
    assert store.get("abc") == b"v" and raw.get("other:abc") == b"w"


def test_exists_prefix_counts_only_the_leading_run(redis_server: RedisServer) -> None:
    raw = redis_server.raw()
    store = RedisStorage(redis_server.url)
    ks = keys(6)
    assert store.exists_prefix(ks) == 0 and store.exists_prefix([]) == 0
    for k in ks:
        assert store.set(k, k.encode())
    assert store.exists_prefix(ks) == 6
    raw.delete(store.name(ks[2]))  # the LRU dropped the middle of the prefix
    assert store.exists_prefix(ks) == 2
    assert store.exists(ks[3])  # present, but after the hole: not counted
    raw.delete(store.name(ks[0]))
    assert store.exists_prefix(ks) == 0
    assert store.stats.errors == 0


def test_exists_prefix_is_one_round_trip(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    store = RedisStorage(redis_server.url)
    ks = keys(40)
    for k in ks:
        store.set(k, b"v")
    sends = []
    real_send = redis.connection.Connection.send_packed_command

    def counting_send(conn: redis.connection.Connection, command: object, check_health: bool = True) -> None:
        sends.append(command)
        real_send(conn, command, check_health)

    # a spy on redis-py's socket write (it still writes): one write of all 40 commands, not 40
    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting_send)
    assert store.exists_prefix(ks) == 40
    assert len(sends) == 1


@pytest.mark.parametrize("bad", ["", ".hidden", "a/b", "../x", "k\x00", "x" * 201, "sp ace", "ns:key"])
def test_a_bad_key_is_a_value_error_before_any_request(bad: str) -> None:
    store = RedisStorage(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens: not asked
    for call in (lambda: store.get(bad), lambda: store.set(bad, b"v"), lambda: store.exists(bad),
                 lambda: store.exists_prefix(["ok", bad])):
        with pytest.raises(ValueError, match="key"):
            call()
    assert store.stats.errors == 0


def test_lru_eviction_under_a_small_maxmemory(redis_server: RedisServer) -> None:
    raw = redis_server.raw()
    store = RedisStorage(redis_server.url)
    ks = keys(200)
    value = b"\x5a" * 64 * 1024  # 200 x 64 KiB = 12.5 MiB into a 4 MB Redis
    for k in ks:
        assert store.set(k, value)  # allkeys-lru makes room, it never refuses a write
    assert int(raw.info("stats")["evicted_keys"]) > 0
    before = [bool(raw.exists(store.name(k))) for k in ks]
    assert 0 < sum(before) < len(ks)
    got = [store.get(k) for k in ks]  # reads can evict too (a reply buffer is memory)
    after = [bool(raw.exists(store.name(k))) for k in ks]
    for k, was, value_got, now in zip(ks, before, got, after):
        assert was or value_got is None, f"{k}: evicted, yet read"  # nothing writes: no key comes back
        assert value_got is None or value_got == value
        assert value_got is not None or not now, f"{k}: a miss, yet present"
    s = store.stats
    assert (s.sets, s.dropped_writes, s.read_errors, s.errors) == (200, 0, 0, 0)  # misses, not errors
    assert 0 < s.hits < len(ks) and s.read_bytes == s.hits * len(value)
    n = store.exists_prefix(ks)
    assert all(raw.exists(store.name(k)) for k in ks[:n]) and (n == len(ks) or not raw.exists(store.name(ks[n])))


def test_a_killed_server_is_misses_and_dropped_writes_then_a_reconnect(redis_server: RedisServer) -> None:
    store = RedisStorage(redis_server.url, timeout_s=TIMEOUT_S, cooldown_s=0)  # every call asks Redis
    ks = keys(3)
    for k in ks:
        assert store.set(k, b"before")
    redis_server.kill()  # SIGKILL mid-use: the pool's connection is now dead
    calls = [lambda: store.get(ks[0]), lambda: store.set(ks[1], b"v"), lambda: store.exists(ks[0]),
             lambda: store.exists_prefix(ks), lambda: store.get(ks[2])]
    results = [timed(call)[0] for call in calls]  # each within CALL_BOUND_S, no exception
    assert results == [None, False, False, 0, None]
    s = store.stats
    assert (s.read_errors, s.dropped_writes, s.errors) == (2, 1, 5)
    assert (s.hits, s.written_bytes) == (0, 3 * len(b"before"))

    redis_server.restart()  # same port, empty (a pure cache keeps nothing); it answers PING now
    assert store.set("after", b"back")  # the same object, no cool-down: the first call reconnects
    assert store.get("after") == b"back" and store.get(ks[0]) is None  # a miss, not an error
    assert store.exists_prefix(["after"]) == 1
    assert (store.stats.read_errors, store.stats.errors) == (2, 5)


def test_a_hung_server_costs_one_timeout_per_cooldown(redis_server: RedisServer) -> None:
    store = RedisStorage(redis_server.url, timeout_s=TIMEOUT_S, cooldown_s=5.0)  # past any pause of this process
    assert store.set("abc", b"v")
    redis_server.pause()  # SIGSTOP: connections are accepted, nothing answers
    got, took = timed(lambda: store.get("abc"))
    assert got is None and store.stats.errors == 1
    assert TIMEOUT_S * 0.8 < took < CALL_BOUND_S, f"the first call took {took:.2f} s"
    # within the cool-down: failed at once, not a timeout each
    _, took = timed(lambda: [store.get("abc"), store.set("abc", b"w"), store.exists("abc"),
                             store.exists_prefix(["abc"])])
    assert took < 4 * TIMEOUT_S, f"four calls in the cool-down took {took:.2f} s"  # not a timeout each
    s = store.stats
    assert (s.errors, s.read_errors, s.dropped_writes) == (1, 2, 1)

    redis_server.resume()
    poll(lambda: store.get("abc") == b"v", "a read after the server came back")


def test_a_dead_redis_does_not_stop_the_backend_from_being_built() -> None:
    store = RedisStorage(f"redis://127.0.0.1:{free_port()}/0", timeout_s=TIMEOUT_S)
    assert store.get("abc") is None and store.set("abc", b"v") is False
    assert store.stats.errors == 1  # the set fell in the cool-down the get started


def test_urls_and_the_default() -> None:
    assert parse_url("redis://127.0.0.1:6379/0") == ("127.0.0.1", 6379, 0)
    assert parse_url("redis://[::1]:6380/2") == ("::1", 6380, 2)
    assert parse_url("redis://cache.local:7000") == ("cache.local", 7000, 0)
    assert open_backend("redis").url == DEFAULT_URL == "redis://127.0.0.1:6379/0"
    assert open_backend("redis", "redis://10.0.0.5:7000/3").url == "redis://10.0.0.5:7000/3"  # no connection made


@pytest.mark.parametrize("url", [
    "redis://host", "redis://h:port/0", "redis://h:0/0", "redis://h:99999", "redis://:6379/0", "rediss://h:1/0",
    "redis://h:1/db", "redis://h:1/0/1", "redis://:pw@h:1/0", "redis://u@h:1/0", "redis://h:1/0?x=1",
    "file:///tmp/kv", "",
])
def test_a_bad_redis_url_names_the_field(url: str) -> None:
    with pytest.raises(ValueError, match="^hicache_storage_url: the redis backend takes redis://host:port"):
        open_backend("redis", url)
