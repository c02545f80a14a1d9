"""The asynchronous save's device-independent parts (ketch/cache/host_saver.py, host_pool.py,
storage_tier.py): which saves are in flight per host page (fake events), host allocations in
contiguous runs, the host-page generation the L3 writer checks, the device-reuse guard, the
save-copy metric. The CUDA copy stream itself: tests/test_hicache_cuda.py."""
from __future__ import annotations

import threading

import torch
from conftest import make_tiny_engine
from test_hicache_l2 import DEVICE_PAGES, PS, multi_turn, scraped

from ketch.cache.host_pool import HostPool
from ketch.cache.host_saver import SaveLog
from ketch.cache.kv_pool import KVPool
from ketch.cache.layer_loader import page_runs
from ketch.cache.page_format import PageFormat
from ketch.cache.storage.file import FileStorage
from ketch.cache.storage_tier import StorageTier
from ketch.config import KVSpec


class FakeEvent:
    """A copy-stream event whose completion the test decides."""

    def __init__(self, log: list[str], name: str) -> None:
        self.done, self.log, self.name = False, log, name

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(self.name)
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 2.0  # ms


def _saves(log: SaveLog, calls: list[str], pages: list[list[int]]) -> list[FakeEvent]:
    ends = []
    for i, p in enumerate(pages):
        ends.append(FakeEvent(calls, f"end{i}"))
        log.add(p, FakeEvent(calls, f"start{i}"), ends[-1])
    return ends


def test_reusing_a_page_waits_only_for_its_own_save() -> None:
    calls: list[str] = []
    log = SaveLog(8)
    ends = _saves(log, calls, [[0, 1], [2, 3], [4]])
    log.wait_pages([5, 6, 7])  # never saved into: no wait, no CUDA call
    assert calls == [] and log.done == 0
    log.wait_pages([1, 7])  # save 0 wrote page 1: its end only
    assert calls == ["end0"] and log.done == 1
    ends[2].done = True  # the stream got further by itself; save 1 must have finished too (in order)
    ends[1].done = True
    log.wait_pages([2, 4])
    assert calls == ["end0"] and log.done == 3 and log.last_inflight() is None
    assert log.collect_seconds() == 3 * 2.0 / 1e3 and log.collect_seconds() == 0.0


def test_waiting_for_a_later_save_implies_the_earlier_ones() -> None:
    calls: list[str] = []
    log = SaveLog(4)
    ends = _saves(log, calls, [[0], [1], [0, 2]])
    assert log.last_inflight() is ends[2]
    log.wait_pages([0])  # the newest save into page 0 is the third
    assert calls == ["end2"]
    for e in ends[:2]:
        e.done = True  # one stream: they finished before the third
    log.retire()
    assert log.done == 3 and log.last_inflight() is None


def test_host_pages_come_back_in_ascending_runs_and_bump_their_generation() -> None:
    pool = KVPool(KVSpec.mha(2, 2, 4), 16, 4, torch.float32, "cpu")
    host = HostPool(pool, 12)
    a, b = host.alloc(4), host.alloc(4)
    host.free(a)
    host.free(b)  # LIFO free list: b's pages come out first, reversed
    again = host.alloc(8)
    assert again == list(range(8))
    assert len(page_runs(range(8), again)) == 1  # one DMA per tensor for a save of these
    assert host.generation[:8] == [2] * 8 and host.generation[8:] == [0] * 4


def test_cpu_saves_are_synchronous_and_guard_nothing() -> None:
    pool = KVPool(KVSpec.mha(2, 2, 4), 16, 4, torch.float32, "cpu")
    host = HostPool(pool, 12)
    assert host.saver is None and host.last_save() is None
    for layer in pool.layers:
        for t in layer.values():
            t.copy_(torch.randn_like(t))
    host.save([3, 9], [0, 5])
    host.guard_device_reuse()  # nothing in flight on the CPU: returns at once
    for layer, hl in zip(pool.layers, host.layers, strict=True):
        for n, t in layer.items():
            assert torch.equal(hl[n][[0, 5]], t[[3, 9]])
    st = host.collect_timings()
    assert st.saved_pages == 2 and st.save_copy_seconds > 0 and st.saved_seconds >= st.save_copy_seconds


def test_the_l3_writer_takes_rows_after_the_save_and_drops_a_reused_page(tmp_path, monkeypatch) -> None:
    """The CUDA path's logic with a fake saver: the writer thread waits for the save's end event
    (not the engine thread), and a host page handed out again before it copied is not written."""
    pool = KVPool(KVSpec.mha(2, 2, 4), 16, 4, torch.float32, "cpu")
    host = HostPool(pool, 12)
    calls: list[str] = []
    gate = threading.Event()

    class HeldSave(FakeEvent):
        def synchronize(self) -> None:  # the copy stream is "slow": the writer waits here
            self.log.append(threading.current_thread().name)
            gate.wait(5.0)
            self.done = True
    event = HeldSave(calls, "save")
    monkeypatch.setattr(host, "saver", object())  # "CUDA": rows are taken by the writer
    monkeypatch.setattr(host, "last_save", lambda: event)
    tier = StorageTier(FileStorage(str(tmp_path)), PageFormat.for_pool(pool, "fp"), host)
    pages = host.alloc(2, for_save=True)  # (for_save: no fence of the fake's absent loader)
    for hl in host.layers:
        for t in hl.values():
            t[pages] = 7.0
    tier.save([b"a" * 32, b"b" * 32], pages)
    host.free([pages[1]])
    assert host.alloc(1, for_save=True) == [pages[1]]  # handed out again: its generation moved
    gate.set()
    assert tier.drain(5.0)
    assert calls and set(calls) == {"ketch-l3-writer"}  # waited for on the writer thread only
    assert tier.stats.written_pages == 1 and tier.stats.dropped_writes == 1
    tier.close()


def test_save_copy_seconds_reach_metrics(tiny_config_path: str) -> None:
    eng = make_tiny_engine(tiny_config_path, kv_cache_memory=DEVICE_PAGES * 2048, page_size=PS,
                           enable_hierarchical_cache=True, hicache_ratio=8.0)
    multi_turn(eng)
    host = eng.kv.host_pool
    assert host is not None and host.stats.saved_pages > 0
    shown = scraped(eng)
    assert shown["ketch_hicache_save_copy_seconds_total"] == host.stats.save_copy_seconds > 0
