"""The storage tier (L3) where the file system or a backend misbehaves, and at exit: a store the
engine cannot even stat is a miss, not a crash of the step; a backend that raises something
other than an OSError costs that page, not the writer; an engine never closed still lands its
queued pages when the interpreter exits; page files get the umask's mode (another user's engine
on a shared store reads them); a prefetch's pin covers all it adopted when the tree grew during
the read. (test_hicache_l3_faults.py: damaged pages, dead stores, bad options.)"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import drain
from test_hicache_l2 import PARAMS, PS, multi_turn
from test_hicache_l3 import LONG, file_url, finish, l3_engine, over_a_stored_long, reference  # noqa: F401  (reference: the fixture)

from ketch.cache.storage.backend import StorageStats
from ketch.cache.storage.file import FileStorage, file_mode
from ketch.cache.storage_tier import StorageTier
from ketch.sampling.params import SamplingParams

TOO_LONG = "d" * 300  # a path component over NAME_MAX: stat fails with ENAMETOOLONG, not "not there"


def test_a_store_the_engine_cannot_stat_is_a_miss_not_a_crash(tiny_config_path: str, reference, tmp_path: Path) -> None:
    """exists() runs on the engine thread (the local store's prefetch check); an OSError that
    Path.is_file() does not swallow (here ENAMETOOLONG; EACCES or a stale NFS handle alike) must
    not end the step: every turn is answered as without a store, reads counted as errors."""
    store = FileStorage(tmp_path / TOO_LONG / "kv")
    assert store.exists("ab" * 8) is False and store.stats.read_errors == 1
    eng = l3_engine(tiny_config_path, file_url(tmp_path / TOO_LONG / "kv"))
    assert multi_turn(eng) == reference
    s = eng.stats()
    assert s.storage_hit_tokens == 0 and s.storage_read_errors > 0 and s.storage_dropped_writes > 0
    finish(eng)


def test_a_nul_byte_in_the_store_directory_is_refused() -> None:
    with pytest.raises(ValueError, match="hicache_storage_url.*NUL"):
        FileStorage("/tmp/kv\x00store")


def test_page_files_get_the_umask_mode(tmp_path: Path) -> None:
    """mkstemp's 0600 would keep another user's engine on a shared store from reading the pages."""
    old = os.umask(0o022)
    file_mode.cache_clear()  # the mode is read from the umask once
    try:
        store = FileStorage(tmp_path)
        assert store.set("ab" * 8, b"page")
        assert store.path("ab" * 8).stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)
        file_mode.cache_clear()


class _FirstSetRaises:
    """A third-party backend with a bug on its first write (not an OSError: no backend contract
    covers it); the rest of its writes work."""

    local = True

    def __init__(self) -> None:
        self.stats = StorageStats()
        self.stored: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.stored.get(key)

    def set(self, key: str, value: bytes) -> bool:
        if not self.stored and not self.stats.sets:
            self.stats.sets += 1
            raise ValueError("a bug in the backend")
        self.stats.sets += 1
        self.stored[key] = value
        return True

    def exists(self, key: str) -> bool:
        return key in self.stored

    def exists_prefix(self, keys: Sequence[str]) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.stored), len(keys))


def test_the_writer_outlives_a_backend_that_raises(tiny_config_path: str, tmp_path: Path) -> None:
    """The page whose write raised is dropped and counted; the writer goes on with the next ones
    and close() does not wait out its deadline on a dead writer."""
    eng = l3_engine(tiny_config_path, file_url(tmp_path / "kv"))
    tier: StorageTier = eng.kv.storage  # type: ignore[assignment]
    backend = _FirstSetRaises()
    tier.backend = backend
    eng.add_request("a", LONG, PARAMS)
    drain(eng)
    eng.kv.flush()  # host pages written back to storage, through the writer
    assert tier.drain(10.0)
    assert tier.stats.write_failures == 1 and tier.stats.dropped_writes == 1
    assert tier.stats.written_pages == len(backend.stored) >= (len(LONG) - 1) // PS - 1
    finish(eng)


_EXIT_SCRIPT = textwrap.dedent("""
    import sys
    from ketch import LLM
    from ketch.sampling.params import SamplingParams
    llm = LLM(model=sys.argv[1], load_format="dummy", dtype="float32", page_size=4, kv_cache_memory=400 * 2048,
              enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_url="file://" + sys.argv[2])
    prompts = [[3 + (i * 7 + j) % 500 for i in range(300)] for j in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    if sys.argv[3] == "close":
        llm.close()
""")


def _pages_after(script_end: str, config: str, store: Path) -> list[Path]:
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, config, str(store), script_end], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [p for p in store.rglob("*") if p.is_file()]


def test_an_llm_never_closed_lands_its_queued_pages_at_exit(tiny_config_path: str, tmp_path: Path) -> None:
    """A script that generates and ends (the README's offline example closes nothing): the pages
    still queued for the store at exit are written before the interpreter goes, as close() writes
    them (they were lost, and the process could abort with the writer thread inside torch), and
    nothing half-written stays."""
    closed = _pages_after("close", tiny_config_path, tmp_path / "closed")
    ended = _pages_after("end", tiny_config_path, tmp_path / "ended")
    assert len(closed) > 100 and len(ended) == len(closed)
    assert not [p for p in ended if p.name.startswith(".tmp-")]


def test_a_prefetch_pin_covers_what_it_adopted_after_the_tree_grew(tiny_config_path: str, tmp_path: Path) -> None:
    """Two prefetches of one stored prompt, a short and a long, start on an empty tree; the short
    one settles first, so the long one's pages start after it. Its pin must reach the end of
    what it adopted: host eviction before its request is admitted keeps every page it read."""
    eng = over_a_stored_long(tiny_config_path, tmp_path)
    whole = (len(LONG) - 1) // PS
    short = eng.kv.prefetch(LONG[: 3 * PS] + [9])
    long = eng.kv.prefetch(LONG)
    assert short is not None and long is not None and short.done.wait(10.0) and long.done.wait(10.0)
    assert eng.kv.settle_prefetch(short) == 3 * PS
    assert eng.kv.settle_prefetch(long) == (whole - 3) * PS
    eng.kv.unpin(short)
    eng.kv.tree.evict_host(10 ** 6)  # host pressure before the long request is admitted
    assert eng.kv.tree.peek(LONG) == whole * PS
    eng.kv.unpin(long)
    eng.check_invariants()
    eng.add_request("b", LONG, SamplingParams(temperature=0.0, max_tokens=1))
    drain(eng)
    finish(eng)
