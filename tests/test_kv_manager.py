"""KVCacheManager: page ownership for the scheduler (admit, reserve, publish, release, rollback),
chained page hashes on the radix tree and the insert/evict events it emits, and export()."""
from __future__ import annotations

import hashlib
import struct

import pytest
import torch
from conftest import assert_drained, drain, make_tiny_engine

from page_holder import Holder
from ketch.cache.kv_pool import KVPool
from ketch.cache.manager import KVCacheManager
from ketch.config import KVSpec
from ketch.sampling.params import SamplingParams

PS = 4


def expected_hashes(tokens: list[int], page_size: int) -> list[bytes]:
    """The documented chain, written out independently: sha256(parent ‖ ids as u32 LE), root b""."""
    out, parent = [], b""
    for lo in range(0, len(tokens) // page_size * page_size, page_size):
        parent = hashlib.sha256(parent + struct.pack(f"<{page_size}I", *tokens[lo : lo + page_size])).digest()
        out.append(parent)
    return out


class Recorder:
    def __init__(self) -> None:
        self.live: dict[bytes, int] = {}  # hash -> page, as the events describe the cache
        self.stored_count = self.removed_count = 0

    def stored(self, hashes: list[bytes], pages: list[int]) -> None:
        assert len(hashes) == len(pages)
        for h, p in zip(hashes, pages, strict=True):
            assert h not in self.live, "a page stored twice under one hash"
            self.live[h] = p
        self.stored_count += len(pages)

    def removed(self, hashes: list[bytes], pages: list[int]) -> None:
        for h, p in zip(hashes, pages, strict=True):
            assert self.live.pop(h) == p, "an evicted page named by another page's hash"
        self.removed_count += len(pages)


def manager(num_pages: int = 16, events: Recorder | None = None) -> KVCacheManager:
    pool = KVPool(KVSpec.mha(2, 1, 4), num_pages, PS, torch.float32, torch.device("cpu"))
    return KVCacheManager(pool, events=events)


def tree_hashes(kv: KVCacheManager) -> dict[bytes, int]:
    return {h: p for n in kv.tree.nodes() for h, p in zip(n.hashes, n.pages, strict=True)}


def test_hashes_chain_through_inserts_splits_and_trims() -> None:
    rec = Recorder()
    kv = manager(events=rec)
    a = Holder(list(range(100, 113)))  # 3 full pages + 1 token
    assert kv.admit(a, kv.match(a.ids[:-1]), len(a.ids))
    a.num_computed = len(a.ids)
    kv.publish(a)
    assert [h for n in kv.tree.nodes() for h in n.hashes] == expected_hashes(a.ids, PS)
    # a second sequence sharing two pages splits the edge; every node's hashes still chain
    b = Holder(a.ids[:8] + [7, 7, 7, 7, 9])
    hit = kv.match(b.ids[:-1])
    assert hit.length == 8 and hit.pages == a.page_table[:2] and hit.tier == "device"
    assert kv.admit(b, hit, len(b.ids))
    b.num_computed = len(b.ids)
    kv.publish(b)
    by_path = {tuple(expected_hashes(x.ids, PS)) for x in (a, b)}
    for n in kv.tree.nodes():
        path_hashes, m = [], n
        while m is not None and m is not kv.tree.root:
            path_hashes[:0] = m.hashes
            m = m.parent
        assert any(list(p[: len(path_hashes)]) == path_hashes for p in by_path)
    kv.check_invariants([a, b])
    assert rec.live == tree_hashes(kv)
    kv.release(a)
    kv.release(b)
    # evict one page (a trim of a leaf's tail), then everything: the events follow exactly
    kv.tree.evict(1)
    assert rec.live == tree_hashes(kv) and rec.removed_count == 1
    kv.tree.reset()
    assert rec.live == {} and rec.stored_count == rec.removed_count == 4
    kv.check_invariants([])
    kv.check_idle()


def test_hashes_name_content_not_place() -> None:
    """The same tokens get the same hashes in another manager, whatever pages hold them."""
    ids = list(range(40, 57))
    kvs = [manager(), manager()]
    kvs[1].allocator.alloc(5)  # different page ids in the second pool
    got = []
    for kv in kvs:
        h = Holder(ids)
        assert kv.admit(h, kv.match(ids[:-1]), len(ids))
        h.num_computed = len(ids)
        kv.publish(h)
        got.append([x for n in kv.tree.nodes() for x in n.hashes])
    assert got[0] == got[1] == expected_hashes(ids, PS)
    assert kvs[0].tree.nodes()[0].pages != kvs[1].tree.nodes()[0].pages


def test_admit_changes_nothing_when_the_pool_cannot_make_room() -> None:
    kv = manager(num_pages=4)
    a = Holder(list(range(12)))
    assert kv.admit(a, kv.match(a.ids[:-1]), 12)  # 3 of 4 pages
    b = Holder(list(range(50, 62)))
    hit = kv.match(b.ids[:-1])
    assert not kv.admit(b, hit, 12)
    assert b.page_table == [] and b.cache_node is None and kv.allocator.num_free == 1
    assert not kv.reserve(a, 20) and len(a.page_table) == 3  # 5 pages: nothing taken
    assert kv.reserve(a, 16) and len(a.page_table) == 4
    kv.check_invariants([a])
    kv.release(a)
    kv.check_idle()


def test_rollback_forgets_computed_tokens_but_never_published_pages() -> None:
    kv = manager()
    a = Holder(list(range(10)))
    assert kv.admit(a, kv.match(a.ids[:-1]), 10)
    a.num_computed = 10
    kv.publish(a)  # 2 full pages published
    kv.rollback(a, 2)
    assert a.num_computed == 8
    with pytest.raises(ValueError, match="rollback"):
        kv.rollback(a, 1)  # would reach into a published page
    with pytest.raises(ValueError, match="rollback"):
        kv.rollback(a, -1)
    kv.release(a)
    kv.check_idle()


def test_export_describes_every_pool_buffer() -> None:
    kv = manager(num_pages=6)
    bufs = kv.export()
    assert [(b.layer, b.name) for b in bufs] == [(0, "k"), (0, "v"), (1, "k"), (1, "v")]
    for b in bufs:
        t = getattr(kv.pool, b.name)[b.layer]
        assert t is kv.pool.tensor(b.layer, b.name)
        assert b.ptr == t.data_ptr() and b.nbytes == t.numel() * t.element_size() == 6 * b.page_bytes
        page = 3  # page p is at ptr + p * page_bytes
        assert t[page].data_ptr() == b.ptr + page * b.page_bytes


def test_engine_events_match_its_tree_through_a_workload(tiny_config_path: str) -> None:
    """Through real engine steps (shared prefixes, evictions under a small pool, preemption),
    the events an observer receives describe exactly the pages the tree holds."""
    eng = make_tiny_engine(tiny_config_path, kv_cache_memory=24 * 2048, page_size=PS)  # 24 pages
    assert eng.allocator.num_pages == 24
    rec = Recorder()
    eng.kv.tree.events = rec
    system = list(range(1, 18))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(10):
        eng.add_request(f"r{i}", system + [50 + i, 60 + i, 70 + i], params)
    drain(eng)
    assert rec.stored_count > 0 and rec.removed_count > 0  # both kinds happened
    assert rec.live == tree_hashes(eng.kv)
    for n in eng.kv.tree.nodes():  # and the tree's hashes are the documented chain of its paths
        ids: list[int] = []
        m = n
        while m is not eng.kv.tree.root:
            ids[:0] = m.key
            m = m.parent
        assert expected_hashes(ids, PS)[-len(n.hashes):] == n.hashes
    assert_drained(eng)
    assert rec.live == {}
