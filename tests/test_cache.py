"""PageAllocator and RadixCache: unit cases plus a randomized request simulation."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from ketch.cache.allocator import OutOfPages, PageAllocator
from ketch.cache.radix import RadixCache

PS = 2


def make(num_pages: int = 32, page_size: int = PS, enabled: bool = True):
    a = PageAllocator(num_pages)
    return a, RadixCache(page_size, a, enabled)


def put(a: PageAllocator, t: RadixCache, tokens: list[int]):
    """Insert like a finished request: alloc own pages, insert, drop own refs."""
    pages = a.alloc(len(tokens) // t.page_size)
    res = t.insert(tokens, pages)
    a.decref(pages)
    t.check_invariants()
    return res, pages


# ---- allocator -------------------------------------------------------------------------


def test_alloc_free_refcount():
    a = PageAllocator(4)
    assert (a.num_pages, a.num_free) == (4, 4)
    p = a.alloc(3)
    assert p == [0, 1, 2] and a.num_free == 1 and all(a.refcount(x) == 1 for x in p)
    a.incref([0, 1])
    assert a.decref([0, 1, 2]) == 1 and a.refcount(0) == 1 and a.num_free == 2
    assert a.decref([0, 1]) == 2 and a.num_free == 4
    assert a.alloc(0) == []


def test_alloc_errors():
    a = PageAllocator(3)
    a.alloc(2)
    with pytest.raises(OutOfPages):
        a.alloc(2)
    assert a.num_free == 1  # all or nothing
    assert issubclass(OutOfPages, RuntimeError)
    with pytest.raises(RuntimeError, match="released twice"):
        a.decref([2])
    with pytest.raises(RuntimeError):
        a.incref([2])
    with pytest.raises(IndexError):
        a.decref([-1])
    with pytest.raises(IndexError):
        a.refcount(3)
    with pytest.raises(ValueError):
        a.alloc(-1)


# ---- match and insert -------------------------------------------------------------------


def test_match_empty_and_partial_page():
    a, t = make()
    assert t.match([1, 2, 3]).length == 0
    put(a, t, [1, 2, 3, 4])
    assert t.match([]).length == 0
    r = t.match([1, 2, 3])  # partial second page never matches
    assert r.length == 2 and len(r.pages) == 1 and r.node.end == 2
    assert t.match([1]).length == 0 and t.match([9, 9, 9, 9]).node is t.root
    t.check_invariants()


def test_match_exact_and_deeper():
    a, t = make()
    (res, pages) = put(a, t, [1, 2, 3, 4])
    r = t.match([1, 2, 3, 4])
    assert (r.length, r.node) == (4, res.node) and r.pages == pages
    r = t.match([1, 2, 3, 4, 5, 6, 7])
    assert (r.length, r.node, r.pages) == (4, res.node, pages)
    assert t.stats.match_queries == 2 and t.stats.matched_tokens == 8


def test_insert_duplicate_prefix_caller_keeps_pages():
    a, t = make()
    res, first = put(a, t, [1, 2, 3, 4])
    mine = a.alloc(3)
    r = t.insert([1, 2, 3, 4, 5, 6], mine)
    assert (r.prefix_len, r.new_pages) == (4, 1)
    assert [a.refcount(p) for p in mine] == [1, 1, 2]  # duplicates not taken
    assert t.match([1, 2, 3, 4, 5, 6]).pages == first + [mine[2]]
    assert r.node.parent is res.node  # extended the leaf with a child
    assert a.decref(mine) == 2 and t.cached_pages == 3 == t.evictable_pages
    again = a.alloc(3)
    r = t.insert([1, 2, 3, 4, 5, 6], again)
    assert (r.new_pages, r.prefix_len) == (0, 6)
    a.decref(again)
    assert a.num_free + t.evictable_pages == a.num_pages
    t.check_invariants()


def test_insert_branching_and_split():
    a, t = make()
    r1, p1 = put(a, t, [1, 2, 3, 4, 5, 6])
    r2, p2 = put(a, t, [1, 2, 3, 4, 7, 8])  # diverges mid-edge at a page boundary
    assert r2.prefix_len == 4 and r2.new_pages == 1
    upper = r2.node.parent
    assert upper.key == (1, 2, 3, 4) and upper.pages == p1[:2] and r1.node.parent is upper
    assert r1.node.key == (5, 6) and r1.node.start == 4  # original node kept as lower half
    assert set(upper.children) == {(5, 6), (7, 8)}
    r3, _ = put(a, t, [9, 9])
    assert set(t.root.children) == {(1, 2), (9, 9)} and r3.node.parent is t.root
    assert t.cached_pages == 5 and t.stats.splits == 1


def test_insert_ending_mid_edge_and_match_split():
    a, t = make()
    r1, p1 = put(a, t, [1, 2, 3, 4, 5, 6])
    m = t.match([1, 2, 3, 4, 9])  # ends mid-edge: split so node covers exactly 4
    assert m.length == 4 and m.node.end == 4 and m.pages == p1[:2]
    assert r1.node.parent is m.node and r1.node.pages == p1[2:]
    r = t.insert([1, 2], a.alloc(1))
    assert r.node.end == 2 and r.new_pages == 0 and r.prefix_len == 2
    assert t.match([1, 2, 3, 4, 5, 6]).node is r1.node
    t.check_invariants()


def test_peek_has_no_side_effects():
    a, t = make()
    res, p = put(a, t, [1, 2, 3, 4, 5, 6])
    before = (t.stats.match_queries, res.node.last_access, t.stats.splits)
    assert t.peek([1, 2, 3, 4, 9]) == 4 and t.peek([1, 2, 3, 4, 5, 6, 7]) == 6
    assert t.peek([2]) == 0 and t.peek([1, 2, 3]) == 2
    assert (t.stats.match_queries, res.node.last_access, t.stats.splits) == before
    assert t.cached_page_set() == set(p)


def test_insert_validation():
    a, t = make()
    with pytest.raises(ValueError):
        t.insert([1, 2, 3], a.alloc(1))
    with pytest.raises(ValueError):
        t.insert([1, 2], [])
    assert t.insert([], []).node is t.root


# ---- lock, unlock, evict ----------------------------------------------------------------


def test_lock_accounting_along_path():
    a, t = make()
    r1, _ = put(a, t, [1, 2, 3, 4])
    r2, _ = put(a, t, [1, 2, 3, 4, 5, 6, 7, 8])
    assert t.evictable_pages == 4
    t.lock(r2.node)
    assert (t.evictable_pages, r1.node.lock_ref, r2.node.lock_ref) == (0, 1, 1)
    t.lock(r1.node)
    assert r1.node.lock_ref == 2
    r3, _ = put(a, t, [1, 2, 3, 4, 0, 0])  # fresh child of a locked node is evictable
    assert r3.node.lock_ref == 0 and t.evictable_pages == 1
    t.unlock(r2.node)
    assert t.evictable_pages == 3 and r1.node.lock_ref == 1
    t.unlock(r1.node)
    assert t.evictable_pages == t.cached_pages == 5
    with pytest.raises(RuntimeError):
        t.unlock(r1.node)
    t.check_invariants()


def test_split_preserves_locks():
    a, t = make()
    r, _ = put(a, t, [1, 2, 3, 4, 5, 6])
    t.lock(r.node)
    m = t.match([1, 2, 3, 4])
    assert m.node.lock_ref == 1 and t.evictable_pages == 0
    t.check_invariants()
    t.unlock(r.node)
    assert m.node.lock_ref == 0 and t.evictable_pages == 3


def test_evict_lru_order_and_parent_becomes_leaf():
    a, t = make(num_pages=16)
    rb, _ = put(a, t, [1, 1, 2, 2])
    ra, _ = put(a, t, [1, 1, 3, 3])
    rc, _ = put(a, t, [4, 4])
    t.match([1, 1, 2, 2])  # b (and shared parent) now most recent; a is oldest leaf
    assert t.evict(1) == 1
    assert ra.node.parent is None and t.match([1, 1, 3, 3]).length == 2
    assert t.evict(1) == 1 and rc.node.parent is None  # c older than b
    assert t.evict(2) == 2 and t.cached_pages == 0  # b, then parent became a leaf
    assert a.num_free == 16 and t.stats.evicted_pages == 4
    with pytest.raises(RuntimeError, match="evicted"):
        t.lock(rb.node)
    t.check_invariants()


def test_evict_skips_locked_and_trims_partial():
    a, t = make(num_pages=16)
    r1, _ = put(a, t, [1, 1, 2, 2, 3, 3, 4, 4])
    r2, _ = put(a, t, [5, 5])
    t.lock(r2.node)
    assert t.evict(2) == 2  # trims the tail of the 4-page leaf, keeps its head
    assert r1.node.pages and len(r1.node.pages) == 2 and r1.node.key == (1, 1, 2, 2)
    assert t.match([1, 1, 2, 2, 3, 3]).length == 4
    assert t.evict(100) == 2 and t.cached_pages == 1 and r2.node.parent is t.root
    t.unlock(r2.node)
    assert t.reset() == 1 and a.num_free == 16
    t.check_invariants()


def test_evict_does_not_free_pages_still_held():
    a, t = make()
    pages = a.alloc(2)
    t.insert([1, 2, 3, 4], pages)  # caller still holds its refs (forgot to lock)
    assert t.evict(2) == 0 and t.cached_pages == 0 and a.refcount(pages[0]) == 1


def test_disabled_cache():
    a, t = make(enabled=False)
    pages = a.alloc(2)
    r = t.insert([1, 2, 3, 4], pages)
    assert (r.node, r.new_pages, r.prefix_len) == (t.root, 0, 0)
    assert a.refcount(pages[0]) == 1 and t.cached_pages == 0
    m = t.match([1, 2, 3, 4])
    assert (m.pages, m.length, m.node) == ([], 0, t.root)
    assert t.evict(5) == 0 and t.reset() == 0


def test_pretty_and_repr():
    a, t = make()
    put(a, t, [1, 2, 3, 4])
    put(a, t, [1, 2, 5, 6])
    put(a, t, [7, 8])
    s = t.pretty()
    assert s.startswith("root") and "├── [1 2]" in s and "└── [7 8]" in s and "│   " in s
    assert "Node#" in repr(t.match([7, 8]).node)


def test_deep_path_no_recursion():
    a, t = make(num_pages=4000, page_size=1)
    toks = list(range(3000))
    pages = a.alloc(3000)
    r = t.insert(toks, pages)
    a.decref(pages)
    for n in range(1, 3000, 3):
        t.match(toks[:n])  # splits the long edge into ~1000 nested nodes
    t.lock(r.node)
    t.check_invariants()
    assert t.pretty().count("\n") == 1001 and t.evictable_pages == 0
    t.unlock(r.node)
    assert t.reset() == 3000 and t.cached_pages == 0


# ---- randomized simulation --------------------------------------------------------------


class Req:
    def __init__(self, tokens: list[int], pages: list[int], node) -> None:
        self.tokens, self.pages, self.node = tokens, pages, node


def _prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    base = rng.choice(prefixes)
    return base[: rng.randint(0, len(base))] + [rng.randrange(4) for _ in range(rng.randint(1, 9))]


def _alloc(a: PageAllocator, t: RadixCache, n: int) -> list[int] | None:
    if a.num_free < n:
        t.evict(n - a.num_free)
    try:
        return a.alloc(n)
    except OutOfPages:
        return None


def _check_refcounts(a: PageAllocator, t: RadixCache, reqs: list[Req]) -> None:
    """Shadow model: refcount == (1 if in tree) + page-table mentions, for every page."""
    expect = [0] * a.num_pages
    for n in t.nodes():
        for p in n.pages:
            expect[p] += 1
    for r in reqs:
        for p in r.pages:
            expect[p] += 1
    assert expect == [a.refcount(p) for p in range(a.num_pages)]
    assert a.num_free == expect.count(0)


@pytest.mark.parametrize("page_size,seed", [(1, 0), (2, 1), (4, 2)])
def test_random_requests(page_size: int, seed: int):
    rng = random.Random(seed)
    a, t = make(num_pages=48, page_size=page_size)
    prefixes = [[rng.randrange(4) for _ in range(30)] for _ in range(3)]
    reqs: list[Req] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.3 or not reqs:  # admit: match prompt[:-1], incref, lock, alloc the rest
            toks = _prompt(rng, prefixes)
            peeked = t.peek(toks[:-1])
            m = t.match(toks[:-1])
            assert m.length == peeked and m.length < len(toks) and m.length % page_size == 0
            a.incref(m.pages)
            t.lock(m.node)
            more = _alloc(a, t, -(-len(toks) // page_size) - len(m.pages))
            if more is None:
                t.unlock(m.node)
                a.decref(m.pages)
            else:
                reqs.append(Req(toks, m.pages + more, m.node))
        elif op < 0.55:  # decode one token, growing the page table when a page fills
            r = rng.choice(reqs)
            r.tokens.append(rng.randrange(4))
            if len(r.tokens) > len(r.pages) * page_size:
                more = _alloc(a, t, 1)
                if more is None:
                    r.tokens.pop()
                else:
                    r.pages += more
        elif op < 0.7:  # cache full pages mid-flight (chunked prefill): lock the new node
            r = rng.choice(reqs)
            full = len(r.tokens) // page_size
            res = t.insert(r.tokens[: full * page_size], r.pages[:full])
            assert res.node.end == full * page_size
            t.lock(res.node)
            t.unlock(r.node)
            r.node = res.node
        elif op < 0.95:  # finish: insert, unlock, release own references
            r = reqs.pop(rng.randrange(len(reqs)))
            full = len(r.tokens) // page_size
            t.insert(r.tokens[: full * page_size], r.pages[:full])
            t.unlock(r.node)
            a.decref(r.pages)
        else:
            t.evict(rng.randint(1, 8))
        t.check_invariants()
        _check_refcounts(a, t, reqs)
        # the tree's own shadow count agrees with this test's model on every step
        t.check_invariants(Counter(p for r in reqs for p in r.pages), Counter(r.node for r in reqs))
        a.check_invariants()
        # requests lock their whole path, so an unlocked tree page has no other holder
        assert all(a.refcount(p) == 1 for n in t.nodes() if n.lock_ref == 0 for p in n.pages)
    for r in reqs:  # drain
        t.unlock(r.node)
        a.decref(r.pages)
    t.check_invariants()
    _check_refcounts(a, t, [])
    assert a.num_free + t.evictable_pages == a.num_pages
    assert t.evictable_pages == t.cached_pages
    assert all(a.refcount(p) == 1 and n.lock_ref == 0 for n in t.nodes() for p in n.pages)
    assert t.stats.matched_tokens > 0 and t.stats.evicted_pages > 0
    t.reset()
    assert a.num_free == a.num_pages and t.cached_pages == 0



@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float8_e4m3fn"])
def test_kv_pool_bytes_per_token_is_a_page_over_its_tokens(dtype_name):
    import torch

    from ketch.cache.kv_pool import KVPool
    from ketch.config import KVSpec

    dtype = getattr(torch, dtype_name)
    pool = KVPool(KVSpec.mha(3, 2, 8), 4, 16, dtype, "cpu")
    assert pool.bytes_per_token * 16 == KVSpec.mha(3, 2, 8).bytes_per_page(16, dtype)
    assert pool.bytes_per_token * 16 * 4 == sum(t.numel() * t.element_size() for t in pool.k + pool.v)
