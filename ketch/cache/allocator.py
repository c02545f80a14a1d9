"""Reference-counted allocator of KV page ids; the KV tensors themselves live in the KV pool.

A page is free exactly when its refcount is 0. Holders (requests, the radix tree) each own
one reference; the last decref returns the page to the free list.

    refcount:  0 ──alloc──▶ 1 ──incref──▶ 2 ... ──decref──▶ ... 1 ──decref──▶ 0 (free again)
               ▲                                                          │
               └──────────────────────── free list ◀──────────────────────┘
"""
from __future__ import annotations

from collections.abc import Iterable


class OutOfPages(RuntimeError):
    """Fewer free pages than asked for; nothing was allocated."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self._num_pages = num_pages
        # Plain lists: per-element access from Python is faster than numpy scalars.
        self._ref: list[int] = [0] * num_pages
        # Stack popped from the end; reversed so a fresh allocator hands out 0, 1, 2, ...
        # (deterministic ids make tests and traces readable).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._num_refs = 0  # sum of all refcounts, kept as it changes (stats read it per scrape)

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_pages - len(self._free)

    @property
    def num_refs(self) -> int:
        """References held on all pages together (a page held by two holders counts twice)."""
        return self._num_refs

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._ref[page]

    def refcounts(self) -> list[int]:
        """Every page's refcount, indexed by page id (a copy: for checks, not the hot loop)."""
        return list(self._ref)

    def alloc(self, n: int) -> list[int]:
        """n pages with refcount 1; all or nothing (raises OutOfPages, allocating none)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free of {self._num_pages}")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()  # keep ascending order for a fresh pool
        ref = self._ref
        for p in pages:
            ref[p] = 1
        self._num_refs += n
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Take one more reference on pages that are already held by someone."""
        ref, n, taken = self._ref, self._num_pages, 0
        try:
            for p in pages:
                if not 0 <= p < n:
                    raise IndexError(f"page id {p} out of range [0, {n})")
                if ref[p] <= 0:
                    raise RuntimeError(f"incref of free page {p}: it has no owner to share it with")
                ref[p] += 1
                taken += 1
        finally:  # the pages before a bad one keep their new reference: count them
            self._num_refs += taken

    def decref(self, pages: Iterable[int]) -> int:
        """Drop one reference on each page; returns how many pages became free.

        Releasing a free page is a bug in the caller (released twice); it raises, and the
        pages before it in `pages` stay released.
        """
        ref, n, free = self._ref, self._num_pages, self._free
        freed = dropped = 0
        try:
            for p in pages:
                if not 0 <= p < n:
                    raise IndexError(f"page id {p} out of range [0, {n})")
                c = ref[p]
                if c <= 0:
                    raise RuntimeError(f"page {p} released twice (refcount already 0)")
                ref[p] = c - 1
                dropped += 1
                if c == 1:
                    free.append(p)
                    freed += 1
        finally:  # the pages before a bad one stay released: count them
            self._num_refs -= dropped
        return freed

    def check_invariants(self) -> None:
        """The free list holds exactly the pages with refcount 0, once each; num_refs is the sum."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        zero = {p for p, c in enumerate(self._ref) if c == 0}
        if free != zero:
            raise AssertionError(f"free list {sorted(free ^ zero)[:8]} disagrees with refcount 0")
        if any(c < 0 for c in self._ref):
            raise AssertionError("negative refcount")
        if sum(self._ref) != self._num_refs:
            raise AssertionError(f"num_refs {self._num_refs} != sum of refcounts {sum(self._ref)}")

    def _check_id(self, page: int) -> None:
        # Negative ids would silently index from the end of the list.
        if not 0 <= page < self._num_pages:
            raise IndexError(f"page id {page} out of range [0, {self._num_pages})")

    def __repr__(self) -> str:
        return f"PageAllocator(num_pages={self._num_pages}, free={len(self._free)})"
