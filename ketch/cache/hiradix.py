"""The radix tree with a host tier (L2): device eviction moves a node's pages to host memory
instead of dropping them, and a hit that reaches host-only nodes is loaded back.

Each node's pages are on the device, on the host, or both (`Node.tier`; `pages` / `host`):

    root ─ [a b c d] both ─ [e f g h] device ─ [i j k l] host ─ [m n o p] host
           (written through)  (not copied yet)   (evicted from the device, kept on the host)

Device residency is closed upwards: a node with device pages has a parent with device pages
(or the root). So a match is a run of device nodes followed by a run of host-only nodes; the
manager loads that run back into fresh device pages (`load_back`), which keeps the property,
and an insert that passes through host-only nodes takes the caller's device pages for them.

    write_through  a node's pages are copied to the host when it is inserted (publish)
    write_back     ... when it is evicted from the device
    device evict   "device leaves" (device pages, no child with device pages), unlocked, LRU
                   first; the node stays as host-only when it has (or gets) a host copy, else it
                   goes with its host-only subtree. Exactly min(num_pages, evictable) leave the
                   device: the last victim is split and its tail moved.
    host evict     host-only leaves (no children, no device pages, unlocked), LRU first; frees
                   their host pages. A locked host-only node (an admission between its lock and
                   its load) is never taken.

Ownership: as RadixCache, one device reference per device page the tree stores; each host page
is held by exactly one node (host refcount 1) and freed when the node leaves the host.
"""
from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from ketch.cache.allocator import PageAllocator
from ketch.cache.host_pool import HostPool
from ketch.cache.page_hash import CacheEvents, chain_hashes
from ketch.cache.radix import RadixCache
from ketch.cache.radix_node import InsertResult, MatchResult, Node
from ketch.config import HICACHE_WRITE_POLICIES


class HiRadixCache(RadixCache):
    def __init__(self, page_size: int, allocator: PageAllocator, host_pool: HostPool,
                 write_policy: str = "write_through", enabled: bool = True,
                 events: CacheEvents | None = None) -> None:
        if write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be {'|'.join(HICACHE_WRITE_POLICIES)}, got {write_policy!r}")
        super().__init__(page_size, allocator, enabled, events)
        self.host_pool = host_pool
        self.write_policy = write_policy
        self._dev_leaves: set[Node] = set()  # nodes with device pages and no child with device pages
        self.host_evicted_pages = 0  # host pages freed by host LRU eviction
        self.dropped_pages = 0  # device pages evicted without a host copy (gone from both tiers)
        # called with (hashes, host pages) whenever pages get a host copy: the L3 tier's writes
        self.on_host_copy: Callable[[list[bytes], list[int]], None] | None = None

    @property
    def host_cached_pages(self) -> int:
        return self.host_pool.num_used

    # ---- lookup and insertion ------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> MatchResult:
        """As RadixCache.match; `pages` covers the device run, `host_len` the host-only rest."""
        m = super().match(tokens)
        m.host_len = m.length - len(m.pages) * self.page_size  # host-only nodes add no pages
        return m

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """As RadixCache.insert, and: host-only nodes on the path take the caller's device pages
        (the same tokens after the same prefix, so the same K/V); write_through copies a new
        node to the host at once."""
        res = super().insert(tokens, pages)
        if not self.enabled:
            return res
        top = self._adopt_path(res.node, pages)
        if res.new_pages and self.write_policy == "write_through":
            self._copy_to_host(res.node)
        self._refresh_from(res.node, min(top, res.node.start))
        adopted = max(0, res.prefix_len - top) // self.page_size
        return InsertResult(res.node, res.new_pages + adopted, min(top, res.prefix_len))

    def load_back(self, node: Node, pages: list[int]) -> None:
        """Put the host-only nodes of `node`'s path back on the device, into `pages` (fresh pages
        the caller holds, in token order); the tree takes one reference on each."""
        run = self._host_run(node)
        want = sum(len(n.host) for n in run)
        if len(pages) != want:
            raise ValueError(f"load_back: {len(pages)} pages for {want} host-only pages on the path")
        self.allocator.incref(pages)  # raises on a free page before any node changes
        i = 0
        for n in run:
            n.pages = list(pages[i:i + len(n.host)])
            i += len(n.pages)
            self._on_device(n)
        # CPU: synchronous, done before the step that reads the pages is launched
        self.host_pool.load([h for n in run for h in n.host], pages)
        self._refresh_from(node, run[0].start if run else node.start)

    def insert_host(self, tokens: Sequence[int], host_pages: list[int]) -> Node:
        """Store the last len(host_pages) pages of `tokens` as a new host-only node (pages read
        from L3 into the host pool); the tree must already hold exactly the rest. The node takes
        the host pages (their one holder); the caller locks whatever must not be evicted meanwhile."""
        ps, t = self.page_size, tuple(tokens)
        node, pos, _ = self._descend(t)
        if len(t) % ps or len(t) - pos != len(host_pages) * ps or not host_pages:
            raise ValueError(f"insert_host: {len(host_pages)} host pages for tokens {pos}:{len(t)} past the cached prefix")
        new = Node(next(self._ids), t[pos:], [], chain_hashes(node.last_hash, t[pos:], ps), node, pos, self._clock)
        new.host = list(host_pages)
        node.children[new.key[:ps]] = new
        self._leaves.discard(node)
        self._leaves.add(new)
        self._touch(new)
        return new

    # ---- eviction ------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Move at least `num_pages` device pages out of the tree (to the host where possible)."""
        return self._evict_device(num_pages, keep=True)

    def reset(self) -> int:
        """Drop every unlocked node from both tiers (locked paths survive); returns device pages freed."""
        freed = self._evict_device(self._evictable, keep=False)
        self.evict_host(self.host_pool.num_pages)
        return freed

    def evict_host(self, num_pages: int) -> int:
        """Free at least `num_pages` host pages (fewer if not enough are evictable): host-only
        unlocked leaves, LRU first. Returns host pages freed."""
        heap = [(n.last_access, n.id, n) for n in self._leaves if not n.pages and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            freed += self._drop_subtree(leaf)
            if parent is not self.root and not parent.children and not parent.pages and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        self.host_evicted_pages += freed
        return freed

    def _evict_device(self, num_pages: int, keep: bool) -> int:
        if not self.enabled or num_pages <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._dev_leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        dropped = freed = 0
        while dropped < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            need = num_pages - dropped
            if need < len(leaf.pages):
                self._split(leaf, (len(leaf.pages) - need) * self.page_size)  # leaf keeps the tail
            victims, gone, parent = leaf.pages, leaf.hashes, leaf.parent
            assert parent is not None
            if keep and not leaf.host:
                self._copy_to_host(leaf)  # write_back's copy; write_through's when the insert found no room
            self._cached -= len(victims)
            self._evictable -= len(victims)
            self._dev_leaves.discard(leaf)
            if keep and leaf.host:
                leaf.pages = []  # stays in the tree, host-only
            else:
                self.dropped_pages += len(victims)
                self._drop_subtree(leaf)
            dropped += len(victims)
            freed += self.allocator.decref(victims)
            if self.events is not None:
                self.events.removed(gone, victims)
            self._refresh(parent)
            if parent in self._dev_leaves and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        self.stats.evicted_pages += dropped
        if dropped:
            self.host_pool.guard_device_reuse()  # a save (CUDA) may still read the freed pages
        return freed

    # ---- internals -----------------------------------------------------------------------

    def _copy_to_host(self, node: Node) -> None:
        """Give `node` a host copy of its device pages if the host can make room (LRU)."""
        n = len(node.pages)
        short = n - self.host_pool.num_free
        if short > 0:
            self.evict_host(short)
        if self.host_pool.num_free >= n:
            node.host = self.host_pool.alloc(n, for_save=True)  # written by the save: stream order
            self.host_pool.save(node.pages, node.host)
            if self.on_host_copy is not None:
                self.on_host_copy(node.hashes, node.host)

    def _adopt_path(self, node: Node, pages: Sequence[int]) -> int:
        """Host-only nodes above `node` (and `node` itself) take the caller's device pages, which
        restores upward closure after an insert below them; returns the start of the topmost
        one (node.end when there is none)."""
        ps, top = self.page_size, node.end
        n = node.parent if node.pages else node  # only a new node can be on the device under host-only ones
        while n is not None and n is not self.root and not n.pages:
            n.pages = list(pages[n.start // ps: n.end // ps])
            self.allocator.incref(n.pages)
            self._on_device(n)
            top = n.start
            n = n.parent
        return top

    def _on_device(self, node: Node) -> None:
        """Account for pages just given to a node (adoption or load)."""
        self._cached += len(node.pages)
        if node.lock_ref == 0:
            self._evictable += len(node.pages)
        if self.events is not None:
            self.events.stored(node.hashes, node.pages)

    def _host_run(self, node: Node) -> list[Node]:
        """The host-only nodes at the end of node's path, top-down."""
        run = []
        while node is not self.root and not node.pages:
            run.append(node)
            node = node.parent  # type: ignore[assignment]
        return run[::-1]

    def _drop_subtree(self, node: Node) -> int:
        """Detach `node` and its descendants (host-only below a device leaf), freeing their host
        pages; returns host pages freed. Device pages are the caller's to release."""
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[: self.page_size]]
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)
        freed, stack = 0, [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self.host_pool.free(n.host)
            freed += len(n.host)
            self._leaves.discard(n)
            self._dev_leaves.discard(n)
            n.parent, n.pages, n.host, n.hashes, n.children = None, [], [], [], {}
        return freed

    def _refresh(self, node: Node) -> None:
        """Recompute whether `node` is a device leaf."""
        if node is not self.root and node.pages and not any(c.pages for c in node.children.values()):
            self._dev_leaves.add(node)
        else:
            self._dev_leaves.discard(node)

    def _refresh_from(self, node: Node, top: int) -> None:
        """`node`'s path gained device pages from token `top` down: refresh those nodes and the
        parent of the topmost (it may have stopped being a device leaf); nothing above changes."""
        while node is not self.root:
            self._refresh(node)
            if node.start <= top:
                self._refresh(node.parent)  # type: ignore[arg-type]
                return
            node = node.parent  # type: ignore[assignment]

    # ---- checks --------------------------------------------------------------------------

    def check_invariants(self, refs: Mapping[int, int] | None = None,
                         locks: Mapping[Node, int] | None = None, pins: Mapping[Node, int] | None = None) -> None:
        """RadixCache's checks, and the host tier's: every host page is free or held by exactly
        one node; device residency is closed upwards; a node locked by a request is on the device
        (a host-only node may be locked only by L3 prefetches pinning it or a descendant: `pins`,
        locks per node); the device-leaf set is exact."""
        super().check_invariants(refs, locks)
        pinned: Counter[Node] = Counter()
        for node, k in (pins or {}).items():
            while node is not self.root:
                pinned[node] += k
                node = node.parent  # type: ignore[assignment]
        nodes = self.nodes()
        held = Counter(h for n in nodes for h in n.host)
        self.host_pool.allocator.check_invariants()
        for h, count in enumerate(self.host_pool.allocator.refcounts()):
            if count != held.get(h, 0) or count > 1:
                raise AssertionError(f"host page {h}: refcount {count}, held by {held.get(h, 0)} nodes")
        for n in nodes:
            if n.pages and n.parent is not self.root and not n.parent.pages:  # type: ignore[union-attr]
                raise AssertionError(f"{n!r} is on the device under a host-only parent")
            if n.lock_ref and not n.pages and n.lock_ref != pinned[n]:
                raise AssertionError(f"{n!r} is locked by a request but not on the device")
        want = {n for n in nodes if n.pages and not any(c.pages for c in n.children.values())}
        if want != self._dev_leaves:
            raise AssertionError(f"device-leaf set off by {sorted(m.id for m in want ^ self._dev_leaves)}")
