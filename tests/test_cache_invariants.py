"""The page checks themselves: PageAllocator's reference total (kept through calls that fail
midway), and the radix tree's shadow count of references and locks (cache/README.md,
"Invariants"), each shown to fail on the state it is there to catch and to pass on the
legitimate state next to it."""
from __future__ import annotations

import pytest

from ketch.cache.allocator import PageAllocator
from test_cache import make, put


def test_num_refs_counts_every_reference_even_when_a_call_fails_midway():
    a = PageAllocator(4)
    p = a.alloc(3)
    a.incref([0, 0, 1])
    assert a.num_refs == 6 == sum(a.refcounts())
    with pytest.raises(RuntimeError):
        a.incref([2, 3])  # 2 took its reference before 3 (free) raised
    assert a.refcount(2) == 2 and a.num_refs == 7
    with pytest.raises(RuntimeError, match="released twice"):
        a.decref([1, 3])  # 1 released before 3 raised
    assert a.refcount(1) == 1 and a.num_refs == 6
    a.check_invariants()
    a.decref(p + [0, 0, 2])
    assert a.num_refs == 0 and a.num_free == 4
    a.check_invariants()


def test_shadow_count_sees_a_leaked_reference_on_a_cached_page():
    a, t = make()
    res, _ = put(a, t, [1, 2, 3, 4])
    page = res.node.pages[0]
    t.check_invariants(refs={}, locks={})
    a.incref([page])  # nobody owns this reference: a leak
    assert a.num_free + t.evictable_pages == a.num_pages  # ...that the page count cannot see
    t.check_invariants()  # nor the tree alone
    with pytest.raises(AssertionError, match=f"page {page}: refcount 2"):
        t.check_invariants(refs={}, locks={})
    t.check_invariants(refs={page: 1}, locks={})  # the same reference, held by a request


def test_shadow_count_needs_one_reference_per_holder_of_a_shared_page():
    a, t = make()
    [private] = a.alloc(1)
    with pytest.raises(AssertionError, match=f"page {private}: refcount 1"):
        t.check_invariants(refs={private: 2}, locks={})  # two requests name it, one reference
    a.incref([private])
    t.check_invariants(refs={private: 2}, locks={})
    with pytest.raises(AssertionError, match=f"page {private}: refcount 2"):
        t.check_invariants(refs={}, locks={})  # allocated, but no holder names it


def test_shadow_count_of_locks():
    a, t = make()
    res, _ = put(a, t, [1, 2, 3, 4])
    t.lock(res.node)
    with pytest.raises(AssertionError, match="own locks"):
        t.check_invariants(refs={}, locks={})  # a lock nobody took
    t.check_invariants(refs={}, locks={res.node: 1})
    upper = t.match([1, 2]).node  # split: the request's lock stays on the lower node
    assert upper is not res.node
    t.check_invariants(refs={}, locks={res.node: 1})
    with pytest.raises(AssertionError, match="own locks"):
        t.check_invariants(refs={}, locks={upper: 1})
    t.unlock(res.node)
    t.evict(t.cached_pages)
    with pytest.raises(AssertionError, match="evicted"):
        t.check_invariants(refs={}, locks={res.node: 1})  # a user still thinks it holds it
