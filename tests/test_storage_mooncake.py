"""The L3 Mooncake backend against a real mooncake_master (tests/mooncake_master.py) and the real
store client (TCP, P2P handshake, no etcd, a 64 MB segment): round trips, overwrite, exists_prefix
over a removed middle key, a value larger than the client's buffer, and faults: a master killed
with SIGKILL (misses, dropped writes, counted, each call bounded in time, then the client's own
reconnect once a master is back) and no master at all when the backend opens. URL checks, the
flags and the lazy import need neither the package nor a master."""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from ketch.cache.storage import BACKENDS, StorageBackend, open_backend
from ketch.cache.storage.mooncake_storage import DEFAULT_URL, MooncakeConfig, MooncakeStorage, parse_url
from ketch.cli import build_parser
from ketch.cli_args import engine_kwargs
from ketch.config import EngineConfig
from mooncake_master import MooncakeMaster, free_port, mooncake_master, require_mooncake  # noqa: F401 (a fixture)

T = TypeVar("T")
SMALL = dict(global_segment_mb=64, local_buffer_mb=16)  # keep the test client's memory small
TIMEOUT_MS = 500
CALL_BOUND_S = TIMEOUT_MS / 1000 + 2.0  # the deadline, plus slack for a loaded 2-core machine
DEADLINE_S = 30.0  # the client's pinger needs 3 failed pings (each up to ~4.4 s) before it reconnects


def keys(n: int) -> list[str]:
    return [f"{i:02x}page{i}" for i in range(n)]


def timed(call: Callable[[], T]) -> tuple[T, float]:
    start = time.monotonic()
    out = call()
    return out, time.monotonic() - start


def poll(ok: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not ok():
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE_S} s"
        time.sleep(0.1)  # the interval between polls; the deadline is what bounds the wait


@pytest.fixture
def store(mooncake_master: MooncakeMaster) -> Iterator[MooncakeStorage]:  # noqa: F811
    s = MooncakeStorage(mooncake_master.url(**SMALL))
    yield s
    s.close()


def test_round_trip_overwrite_and_counters(store: MooncakeStorage) -> None:
    assert isinstance(store, StorageBackend)
    assert store.get("abc") is None and not store.exists("abc")
    assert store.set("abc", b"\x00\x01payload\xff")
    assert store.exists("abc") and store.get("abc") == b"\x00\x01payload\xff"
    assert store.set("abc", b"new")  # overwrite replaces (Mooncake's put would keep the old value)
    assert store.get("abc") == b"new"
    big = bytes(range(256)) * 4096  # 1 MiB: a real page's size class
    assert store.set("big", big) and store.get("big") == big
    s = store.stats
    assert (s.gets, s.hits, s.sets, s.dropped_writes, s.read_errors, s.errors) == (4, 3, 3, 0, 0, 0)
    assert s.written_bytes == s.read_bytes == len(b"\x00\x01payload\xff") + 3 + len(big)


def test_exists_prefix_counts_only_the_leading_run(store: MooncakeStorage) -> None:
    ks = keys(5)
    assert store.exists_prefix(ks) == 0 and store.exists_prefix([]) == 0
    for k in ks:
        assert store.set(k, k.encode())
    assert store.exists_prefix(ks) == 5
    assert store.client.remove(ks[2], True) == 0  # the store dropped the middle of the prefix
    assert store.exists_prefix(ks) == 2
    assert store.exists(ks[3]) and not store.exists(ks[2])  # present, but after the hole: not counted
    assert store.get(ks[2]) is None and store.stats.read_errors == 0  # a miss, not an error
    assert store.client.remove(ks[0], True) == 0
    assert store.exists_prefix(ks) == 0


def test_a_bad_key_is_a_value_error_naming_key(store: MooncakeStorage) -> None:
    # one store for all of them: Mooncake's close takes 1-2 s
    for bad in ["", ".hidden", "a/b", "../x", "k\x00", "x" * 201, "sp ace"]:
        for call in (lambda: store.get(bad), lambda: store.set(bad, b"v"), lambda: store.exists(bad),
                     lambda: store.exists_prefix(["ok", bad])):
            with pytest.raises(ValueError, match="key"):
                call()
    assert (store.stats.gets, store.stats.sets, store.stats.errors) == (0, 0, 0)  # nothing was sent


def test_a_value_larger_than_the_local_buffer_is_dropped_and_counted(mooncake_master: MooncakeMaster) -> None:  # noqa: F811
    store = MooncakeStorage(mooncake_master.url(global_segment_mb=64, local_buffer_mb=1))
    try:
        assert store.set("small", b"x" * 1000)
        assert store.set("huge", b"x" * (2 << 20)) is False  # Mooncake cannot stage it: -600
        assert (store.stats.dropped_writes, store.stats.errors) == (1, 1)
        assert store.get("huge") is None and store.stats.read_errors == 0  # never written: a miss
        assert store.get("small") == b"x" * 1000
    finally:
        store.close()


def test_a_killed_master_gives_misses_and_dropped_writes_in_bounded_time(mooncake_master: MooncakeMaster) -> None:  # noqa: F811
    store = MooncakeStorage(mooncake_master.url(**SMALL, timeout_ms=TIMEOUT_MS), reconnect_s=0.2)
    try:
        ks = keys(3)
        assert all(store.set(k, b"v") for k in ks) and store.exists_prefix(ks) == 3
        mooncake_master.kill()
        calls = [lambda: store.get(ks[0]), lambda: store.set("new", b"v"), lambda: store.exists(ks[0]),
                 lambda: store.exists_prefix(ks)]
        for _ in range(3):  # the deadline, a late call still running, then the client's own flag
            for call in calls:
                out, took = timed(call)
                assert out in (None, False, 0) and took < CALL_BOUND_S, (out, took)
        s = store.stats
        assert (s.read_errors, s.dropped_writes, s.hits) == (3, 3, 0) and s.errors >= 1
        mooncake_master.start()  # a new, empty master on the same port
        poll(lambda: store.set("after", b"back"), "the client reconnects by itself")
        assert store.get("after") == b"back"
        assert store.get(ks[0]) is None  # the old master's objects went with it
    finally:
        if mooncake_master.proc is not None:  # closing needs a master, else it blocks for seconds
            store.close()


def test_no_master_at_open_then_one_starts(tmp_path: Path) -> None:
    master = MooncakeMaster(tmp_path, require_mooncake())
    (store, took) = timed(lambda: MooncakeStorage(master.url(**SMALL, timeout_ms=TIMEOUT_MS), reconnect_s=0.2))
    try:
        assert took < CALL_BOUND_S
        assert store.get("abc") is None and store.set("abc", b"v") is False
        assert (store.stats.read_errors, store.stats.dropped_writes) == (1, 1) and store.stats.errors >= 1
        master.start()
        poll(lambda: store.set("abc", b"v"), "the backend connects once the master is up")
        assert store.get("abc") == b"v"
    finally:
        if master.proc is not None:
            store.close()
            master.kill()


def test_urls() -> None:
    assert parse_url(DEFAULT_URL) == MooncakeConfig("127.0.0.1", 50051)
    cfg = parse_url("mooncake://10.0.0.5:7000/?global_segment_mb=0&local_buffer_mb=128&timeout_ms=250"
                    "&local_hostname=node-3")
    assert cfg == MooncakeConfig("10.0.0.5", 7000, 0, 128, 250, "node-3")
    assert (cfg.master, parse_url("mooncake://[::1]:50051").master) == ("10.0.0.5:7000", "[::1]:50051")


@pytest.mark.parametrize("url", [
    "mooncake://127.0.0.1", "mooncake://:50051", "mooncake://h:99999", "mooncake://h:port", "redis://h:1",
    "mooncake://h:1/path", "mooncake://u:p@h:1", "mooncake://h:1#frag", "mooncake://h:1?size=5",
    "mooncake://h:1?timeout_ms=0", "mooncake://h:1?local_buffer_mb=-1", "mooncake://h:1?timeout_ms=1&timeout_ms=2",
    "mooncake://h:1?local_hostname=", "mooncake://h:1?global_segment_mb", "/no/scheme",
])
def test_a_bad_url_names_the_field(url: str) -> None:
    with pytest.raises(ValueError, match="^hicache_storage_url: the mooncake backend takes mooncake://"):
        open_backend("mooncake", url)  # checked before the package is imported


def test_the_package_is_imported_only_when_the_backend_is_opened(tmp_path: Path) -> None:
    code = ("import sys; import ketch.cache.storage as s, ketch.cache.storage.mooncake_storage; "
            f"s.open_backend('file', 'file://{tmp_path}'); assert 'mooncake' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_a_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)  # what Python does when it is not installed
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ImportError, match="hicache_storage_backend mooncake needs .*pip install mooncake-transfer"):
        open_backend("mooncake", "mooncake://127.0.0.1:1")


def test_the_flags_take_mooncake() -> None:
    assert "mooncake" in BACKENDS
    on = dict(enable_hierarchical_cache=True, hicache_storage_backend="mooncake")
    assert EngineConfig(**on, hicache_storage_url="mooncake://10.0.0.5:50051").hicache_storage_url
    assert EngineConfig(**on).hicache_storage_url is None  # the default: a master on this machine
    with pytest.raises(ValueError, match="^hicache_storage_url: the mooncake backend takes mooncake://"):
        EngineConfig(**on, hicache_storage_url="file:///tmp/kv")
    with pytest.raises(ValueError, match="add --hicache-storage-backend mooncake$"):
        EngineConfig(enable_hierarchical_cache=True, hicache_storage_url="mooncake://h:1")
    argv = ["serve", "--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
            "--hicache-storage-url", "mooncake://h:1"]
    cfg = EngineConfig(**engine_kwargs(build_parser().parse_args(argv)))
    assert (cfg.hicache_storage_backend, cfg.hicache_storage_url) == ("mooncake", "mooncake://h:1")
