"""Page-aligned radix tree mapping token prefixes to KV page ids (prefix caching).

Each edge holds a whole number of pages: `len(key) == len(pages) * page_size`. Children are
keyed by the tokens of their first page, so siblings never share a first page.

    root ─┬─ [a b | c d] pages [3, 7]  ─┬─ [e f] pages [9]        page_size = 2
          │                             └─ [x y | z w] pages [4, 5]
          └─ [q r] pages [1]

Ownership: the tree holds ONE allocator reference on every page stored in it. Requests hold
their own references and lock the deepest node of the path they use; a lock counts on the
node and every ancestor (root excluded), so a locked node's whole path is safe:

    node.lock_ref == locks taken on node itself + sum(child.lock_ref for its children)
    evictable_pages == sum(len(n.pages) for nodes with lock_ref == 0)

Splits keep the ORIGINAL node object as the lower half, so a request holding the deepest
node keeps holding the deepest node after any split above or inside it.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence

from ketch.cache.allocator import PageAllocator
from ketch.cache.page_hash import CacheEvents, chain_hashes
from ketch.cache.radix_node import CacheStats, InsertResult, MatchResult, Node


class RadixCache:
    def __init__(self, page_size: int, allocator: PageAllocator, enabled: bool = True,
                 events: CacheEvents | None = None) -> None:
        """events: told of every page that enters or leaves the tree, by its chained hash."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.enabled = enabled
        self.events = events
        self.stats = CacheStats()
        self._ids = itertools.count()
        self._clock = 0
        self.root = Node(next(self._ids), (), [], [], None, 0, 0)
        self._leaves: set[Node] = set()  # non-root nodes without children
        self._cached = 0  # pages in the tree
        self._evictable = 0  # pages in nodes with lock_ref == 0

    @property
    def cached_pages(self) -> int:
        return self._cached

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    # ---- lookup and insertion ------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens`.

        Only full pages match. The caller passes `prompt[:-1]` (or shorter), never the whole
        prompt: the last prompt token's logits must be computed, so a hit must not cover it.
        Touches the LRU clock on the path; splits an edge when the hit ends inside it. Takes
        no references and no lock: the caller increfs `pages` and locks `node` itself.
        """
        self.stats.match_queries += 1
        self.stats.query_tokens += len(tokens)
        if not self.enabled:
            return MatchResult([], 0, self.root)
        ps = self.page_size
        node, pos, pages = self._descend(tuple(tokens[: len(tokens) // ps * ps]))
        self._touch(node)
        self.stats.matched_tokens += pos
        return MatchResult(pages, pos, node)

    def peek(self, tokens: Sequence[int]) -> int:
        """Length `match` would return, without splitting, touching LRU or counting stats
        (for scheduling policies that rank waiting requests by their hit)."""
        if not self.enabled:
            return 0
        ps = self.page_size
        t = tuple(tokens[: len(tokens) // ps * ps])
        node: Node | None = self.root
        pos = 0
        while node is not None and pos < len(t):
            node = node.children.get(t[pos:pos + ps])
            if node is not None:
                k = self._common(node.key, t, pos)
                pos += k
                if k < len(node.key):
                    break
        return pos

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Store `tokens` (whole pages) backed by `pages`; returns the node covering them all.

        Where the tree already holds a prefix, it keeps its own pages and the caller keeps
        (and must eventually release) its duplicates. The new suffix becomes one fresh
        unlocked node and the tree increfs its pages.
        """
        ps = self.page_size
        if len(tokens) % ps or len(pages) != len(tokens) // ps:
            raise ValueError(f"insert needs whole pages: {len(tokens)} tokens, {len(pages)} "
                             f"pages, page_size {ps}")
        if not self.enabled:
            return InsertResult(self.root, 0, 0)
        t = tuple(tokens)
        node, pos, _ = self._descend(t)
        prefix_len, new_pages = pos, 0
        if pos < len(t):
            mine = list(pages[pos // ps:])
            self.allocator.incref(mine)  # raises on a free page before the node is linked
            hashes = chain_hashes(node.last_hash, t[pos:], ps)
            new = Node(next(self._ids), t[pos:], mine, hashes, node, pos, self._clock)
            node.children[new.key[:ps]] = new
            self._leaves.discard(node)
            self._leaves.add(new)
            self._cached += len(mine)
            self._evictable += len(mine)  # fresh node: lock_ref 0 even under a locked parent
            new_pages = len(mine)
            self.stats.inserted_pages += new_pages
            if self.events is not None:
                self.events.stored(hashes, mine)
            node = new
        self._touch(node)
        return InsertResult(node, new_pages, prefix_len)

    # ---- locking -------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Protect `node` and its ancestors from eviction (one lock per call; root: no-op)."""
        self._check_attached(node)
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        self._check_attached(node)
        if node is not self.root and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of unlocked node {node!r}")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.pages)
            node = node.parent  # type: ignore[assignment]

    # ---- eviction ------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Release at least `num_pages` tree pages (fewer if not enough are evictable).

        Unlocked leaves go in LRU order. The last victim is trimmed from its tail rather than
        dropped whole when it holds more than still needed: deeper tokens are only reachable
        through the shallower ones, so the tail is the least reusable part. Because of the
        trim, exactly min(num_pages, evictable_pages) pages leave the tree. Returns how many
        pages the allocator freed (equal to pages dropped when nobody else references them).
        """
        if not self.enabled or num_pages <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        dropped = freed = 0
        while dropped < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            need = num_pages - dropped
            if need < len(leaf.pages):
                victims, gone = leaf.pages[-need:], leaf.hashes[-need:]
                del leaf.pages[-need:], leaf.hashes[-need:]
                leaf.key = leaf.key[: len(leaf.pages) * self.page_size]
            else:
                victims, gone = leaf.pages, leaf.hashes
                parent = leaf.parent
                assert parent is not None
                del parent.children[leaf.key[: self.page_size]]
                self._leaves.discard(leaf)
                leaf.parent, leaf.pages, leaf.hashes = None, [], []  # detached: lock() on it now raises
                if parent is not self.root and not parent.children:
                    self._leaves.add(parent)
                    if parent.lock_ref == 0:
                        heapq.heappush(heap, (parent.last_access, parent.id, parent))
            dropped += len(victims)
            self._cached -= len(victims)
            self._evictable -= len(victims)
            freed += self.allocator.decref(victims)
            if self.events is not None:
                self.events.removed(gone, victims)
        self.stats.evicted_pages += dropped
        return freed

    def reset(self) -> int:
        """Drop every unlocked node (locked paths survive); returns pages freed."""
        return self.evict(self._evictable)

    # ---- internals -----------------------------------------------------------------------

    def _descend(self, t: tuple[int, ...]) -> tuple[Node, int, list[int]]:
        """Follow `t` while whole pages agree; returns (deepest node, tokens covered, pages).

        When agreement ends inside an edge, the edge is split there so that the returned
        node covers exactly the agreed tokens.
        """
        ps, node, pos, pages = self.page_size, self.root, 0, []
        while pos < len(t):
            child = node.children.get(t[pos:pos + ps])
            if child is None:
                break
            k = self._common(child.key, t, pos)
            inside = k < len(child.key)
            if inside:
                child = self._split(child, k)
            pages.extend(child.pages)
            node, pos = child, pos + k
            if inside:
                break
        return node, pos, pages

    def _common(self, key: tuple[int, ...], t: tuple[int, ...], pos: int) -> int:
        """Page-aligned common prefix of `key` and `t[pos:]`; the first page is known equal."""
        ps = self.page_size
        n = min(len(key), (len(t) - pos) // ps * ps)
        if key[:n] == t[pos:pos + n]:  # common case: whole edge (or whole query) matches
            return n
        i = ps
        while i < n and key[i:i + ps] == t[pos + i:pos + i + ps]:
            i += ps
        return i

    def _split(self, node: Node, k: int) -> Node:
        """Cut node's edge after k tokens; returns the new upper node.

        parent ─[key]─ node      becomes      parent ─[key[:k]]─ upper ─[key[k:]]─ node
        `node` keeps its identity (held by requests), children, lock and leaf status.
        """
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < k < len(node.key) and k % ps == 0
        upper = Node(next(self._ids), node.key[:k], node.pages[: k // ps], node.hashes[: k // ps], parent,
                     node.start, node.last_access)
        upper.lock_ref = node.lock_ref  # every lock below passes through upper
        parent.children[upper.key[:ps]] = upper  # same first page: replaces node
        upper.host = node.host[: k // ps]  # host copies (hiradix.py) split with the pages; [] stays []
        node.key, node.pages, node.hashes = node.key[k:], node.pages[k // ps:], node.hashes[k // ps:]
        node.host = node.host[k // ps:]
        node.start += k
        node.parent = upper
        upper.children[node.key[:ps]] = node
        self.stats.splits += 1
        return upper

    def _touch(self, node: Node) -> None:
        self._clock += 1
        while node is not self.root:
            node.last_access = self._clock
            node = node.parent  # type: ignore[assignment]

    def _check_attached(self, node: Node) -> None:
        if node.parent is None and node is not self.root:
            raise RuntimeError(f"{node!r} was evicted; it can no longer be locked")

    def nodes(self) -> list[Node]:
        """All non-root nodes, parents before children (iterative: paths can be deep)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def cached_page_set(self) -> set[int]:
        """Every page id the tree stores (O(tree): for checks, not the hot loop)."""
        return {p for n in self.nodes() for p in n.pages}

    # ---- debugging -----------------------------------------------------------------------

    def check_invariants(self, refs: Mapping[int, int] | None = None,
                         locks: Mapping[Node, int] | None = None) -> None:
        """Raise AssertionError if the tree is inconsistent (cheap enough for idle checks).

        `refs` (page → references held outside the tree, e.g. mentions in requests' page tables)
        turns the page check into a shadow count over the whole allocator:

            allocator.refcount(page) == (1 if the tree stores page) + refs.get(page, 0)

        so a leaked reference (a cached page still held once too often, which would otherwise
        look evictable) or a missing one (two holders of a page that counts once) fails.
        `locks` (node → locks its users took on it) does the same for lock_ref: each node's own
        locks, lock_ref minus its children's, must equal locks.get(node, 0). Without them only
        refcount >= 1 is checked for tree pages and lock_ref >= the children's sum.
        """
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(msg)

        ps, root = self.page_size, self.root
        need(root.key == () and not root.pages and root.lock_ref == 0, "root must stay empty")
        cached = evictable = 0
        seen: set[int] = set()
        for n in self.nodes():
            p = n.parent
            need(p is not None and p.children.get(n.key[:ps]) is n, f"bad child key {n!r}")
            need(len(n.hashes) > 0 and len(n.key) == len(n.hashes) * ps, f"bad edge {n!r}")
            # device pages, host pages (hiradix.py) or both, each list covering the whole edge
            need(len(n.pages) in (0, len(n.hashes)) and len(n.host) in (0, len(n.hashes)) and (n.pages or n.host),
                 f"a node's pages must cover its edge on some tier {n!r}")
            need(n.hashes == chain_hashes(p.last_hash, n.key, ps), f"page hashes do not chain from the parent's in {n!r}")
            need(n.start == p.end, f"start {n.start} != parent end {p.end} in {n!r}")
            own = n.lock_ref - sum(c.lock_ref for c in n.children.values())
            need(own >= 0, f"lock_ref below children's sum in {n!r}")
            if locks is not None:
                need(own == locks.get(n, 0), f"{n!r} holds {own} own locks, its users took {locks.get(n, 0)}")
            need(p is root or p.last_access >= n.last_access, f"LRU order broken at {n!r}")
            need((n in self._leaves) == (not n.children), f"leaf set wrong for {n!r}")
            for pg in n.pages:
                need(pg not in seen, f"page {pg} stored twice in tree")
                need(self.allocator.refcount(pg) >= 1, f"tree page {pg} is free")
                seen.add(pg)
            cached += len(n.pages)
            evictable += len(n.pages) if n.lock_ref == 0 else 0
        need(all(n.parent is not None for n in self._leaves), "evicted node in leaf set")
        need(cached == self._cached, f"cached_pages {self._cached} != {cached}")
        need(evictable == self._evictable, f"evictable_pages {self._evictable} != {evictable}")
        if locks is not None:
            gone = [n for n, k in locks.items() if k and n is not root and n.parent is None]
            need(not gone, f"locks taken on evicted nodes {gone}")
        if refs is not None:
            for pg, count in enumerate(self.allocator.refcounts()):
                want = (pg in seen) + refs.get(pg, 0)
                need(count == want, f"page {pg}: refcount {count}, but the tree "
                     f"{'stores' if pg in seen else 'does not store'} it and others hold "
                     f"{refs.get(pg, 0)} (a leaked or a missing reference)")

    def pretty(self) -> str:
        lines = [f"root (cached={self._cached}, evictable={self._evictable})"]
        kids = self._sorted(self.root)
        stack = [(c, "", c is kids[-1]) for c in reversed(kids)]
        while stack:
            n, indent, last = stack.pop()
            lines.append(f"{indent}{'└── ' if last else '├── '}[{n.short_key()}] "
                         f"pages={n.pages}{f' host={n.host}' if n.host else ''} lock={n.lock_ref} t={n.last_access}")
            kids = self._sorted(n)
            sub = indent + ("    " if last else "│   ")
            stack.extend((c, sub, c is kids[-1]) for c in reversed(kids))
        return "\n".join(lines)

    @staticmethod
    def _sorted(n: Node) -> list[Node]:
        return [n.children[k] for k in sorted(n.children)]
