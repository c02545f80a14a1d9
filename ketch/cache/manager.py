"""KVCacheManager: the one owner of KV pages — allocator, radix tree (prefix cache) and device pool.

The scheduler decides who runs; this class does what a decision means for pages:

    match(ids)              → Hit(pages, length, node, tier, host_tokens)   no side effects beyond LRU
    admit(holder, hit, n)   lock the hit, take its pages, add pages for n tokens (or change nothing);
                            a hit's host-only part is loaded back into the new pages first
    reserve(holder, n)      pages for n tokens (evicting unlocked cache pages if needed)
    publish(holder)         full, resolved pages into the tree (the holder keeps its references)
    release(holder)         publish, unlock, drop every reference: the holder holds nothing
    rollback(holder, n)     forget the K/V of its last n computed tokens (overlap's extra token
                            after a stop; rejected draft tokens)
    make_room(n)            evict until n pages are free
    export()                the pool's buffers (pointers, sizes) for a KV transport
    check_invariants(hs)    the shadow count of every page's holders (and the host tier's owners)
    usage()                 per tier: total, free, cached (unlocked tree pages), used

With a host pool (the hierarchical cache, cache/hiradix.py) the tree keeps pages evicted from the
device in host memory and a match may reach them; everything else is the same to the scheduler.

A holder is any object with the fields of `PageHolder` (the scheduler's `Request`); the cache
layer never imports the scheduler. Ownership (cache/README.md): a holder has one reference per
page-table entry and one lock on its `cache_node`; the tree has one reference per page it stores.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from ketch.cache.allocator import PageAllocator
from ketch.cache.hiradix import HiRadixCache
from ketch.cache.host_pool import HostPool, host_pages_for
from ketch.cache.kv_pool import KVPool
from ketch.cache.page_format import PageFormat
from ketch.cache.page_hash import CacheEvents
from ketch.cache.radix import RadixCache
from ketch.cache.radix_node import Node
from ketch.cache.storage import open_backend
from ketch.cache.storage_reads import StorageReads
from ketch.cache.storage_tier import Prefetch, StorageTier
from ketch.config import EngineConfig


class PageHolder(Protocol):
    page_table: list[int]  # one allocator reference per entry
    cache_node: Node | None  # the radix node it has locked (its published prefix), or None
    num_computed: int  # tokens whose K/V is in its pages
    num_inserted_pages: int  # leading pages already published to the tree

    @property
    def num_resolved(self) -> int: ...  # leading tokens whose ids are known (overlap: not placeholders)

    def tokens(self, lo: int, hi: int) -> list[int]: ...


@dataclass(frozen=True)
class Hit:
    pages: list[int]  # cached pages covering the first `length` tokens
    length: int  # a multiple of page_size
    node: Node  # the deepest node of the hit (the root for a miss)
    tier: str = "device"  # the deepest tier the hit reaches: "device" or "host" (storage is to come)
    host_tokens: int = 0  # its trailing tokens only on the host: `pages` covers the rest, admit loads these

    @property
    def device_tokens(self) -> int:
        return self.length - self.host_tokens


@dataclass
class TierHits:
    """Tokens of admitted hits by the tier that served them (every admission, re-admissions too)."""

    device_tokens: int = 0
    host_tokens: int = 0


@dataclass(frozen=True)
class HostTierStats:
    """The host tier's counters for /metrics (all 0 without a host tier); O(1) to take."""

    pages_total: int = 0
    pages_free: int = 0
    loaded_bytes: int = 0  # host -> device
    saved_bytes: int = 0  # device -> host
    evicted_pages: int = 0  # host pages freed by host LRU eviction
    dropped_pages: int = 0  # device pages evicted with no host copy (gone from both tiers)
    loaded_seconds: float = 0.0  # host time in loads (CPU: the copies; CUDA: queueing them)
    saved_seconds: float = 0.0  # host time in saves (CPU: the copies; CUDA: queueing them)
    load_copy_seconds: float = 0.0  # the copies' own time (CUDA: copy-stream events; bytes over it: GB/s)
    save_copy_seconds: float = 0.0  # the same for device -> host


@dataclass(frozen=True)
class TierUsage:
    """One tier's pages: free + cached + used == total (cached: unlocked tree pages, evictable)."""

    total: int
    free: int
    cached: int
    used: int


@dataclass(frozen=True)
class LayerBuffer:
    """One KV tensor of one layer, as a transport registers it."""

    layer: int
    name: str  # as the model's KV spec names it: "k", "v"; "latent" for MLA
    ptr: int
    nbytes: int
    page_bytes: int  # bytes of one page: page p lives at ptr + p * page_bytes


class KVCacheManager(StorageReads):
    def __init__(self, pool: KVPool, enable_prefix_cache: bool = True, events: CacheEvents | None = None,
                 host_pool: HostPool | None = None, write_policy: str = "write_through",
                 storage: StorageTier | None = None) -> None:
        """host_pool: turns on the host tier (L2) with `write_policy` (write_through | write_back);
        storage: the L3 tier under it (over the same host pool)."""
        self.pool = pool
        self.page_size = pool.page_size
        self.allocator = PageAllocator(pool.num_pages)
        self.host_pool = host_pool
        self.hits = TierHits()
        self.tree: RadixCache = (
            RadixCache(pool.page_size, self.allocator, enabled=enable_prefix_cache, events=events)
            if host_pool is None else
            HiRadixCache(pool.page_size, self.allocator, host_pool, write_policy, enable_prefix_cache, events))
        self.storage = storage
        self.pins: list[Prefetch] = []  # prefetches in flight, each locking its prompt's cached prefix
        self.dropped_pins = 0  # times make_room dropped every pin to find room
        if storage is not None:
            if host_pool is None or storage.host_pool is not host_pool:
                raise ValueError("hicache_storage_backend: the L3 tier needs the host tier it reads into")
            assert isinstance(self.tree, HiRadixCache)
            self.tree.on_host_copy = storage.save

    @classmethod
    def from_config(cls, pool: KVPool, config: EngineConfig, fingerprint: str = "") -> KVCacheManager:
        """The manager the engine's config asks for (prefix cache, hierarchical cache, L3 storage:
        `fingerprint` names the model whose pages it stores; page_format.py)."""
        host = HostPool(pool, host_pages_for(pool, config), io_backend=config.hicache_io_backend) \
            if config.enable_hierarchical_cache else None
        storage = None
        if host is not None and config.hicache_storage_backend is not None:
            backend = open_backend(config.hicache_storage_backend, config.hicache_storage_url)
            storage = StorageTier(backend, PageFormat.for_pool(pool, fingerprint), host,
                                  config.hicache_storage_write_queue, config.hicache_prefetch_timeout)
        return cls(pool, config.enable_prefix_cache, host_pool=host, write_policy=config.hicache_write_policy,
                   storage=storage)

    # ---------------------------------------------------------------- sizes
    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_pages * self.page_size

    @property
    def prefix_cache_enabled(self) -> bool:
        return self.tree.enabled

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # ---------------------------------------------------------------- lookups
    def peek(self, ids: list[int]) -> int:
        """Tokens of `ids` the cache would serve (no LRU touch: for ranking waiting requests)."""
        return self.tree.peek(ids)

    def match(self, ids: list[int]) -> Hit:
        """The longest cached page-aligned prefix of `ids`; pass all but the last prompt token
        (its logits are needed, so a hit may not cover it)."""
        m = self.tree.match(ids)
        return Hit(m.pages, m.length, m.node, "host" if m.host_len else "device", m.host_len)

    # ---------------------------------------------------------------- holders
    def admit(self, holder: PageHolder, hit: Hit, tokens: int) -> bool:
        """Give `holder` the hit's pages (locked, referenced) and fresh ones up to `tokens`;
        False, with nothing changed, when the pool cannot make room for them. The lock also keeps
        the hit's host-only nodes from host eviction while room is made."""
        self.tree.lock(hit.node)
        self.allocator.incref(hit.pages)
        need = self.pages_for(tokens) - len(hit.pages)
        if not self.make_room(need):
            self.tree.unlock(hit.node)
            self.allocator.decref(hit.pages)
            return False
        fresh = self.allocator.alloc(need)
        if hit.host_tokens:
            # CPU: copied here, before the step that reads these pages is launched. CUDA: queued on
            # a copy stream layer by layer, each layer of the next forward waiting for its own.
            assert isinstance(self.tree, HiRadixCache)
            self.tree.load_back(hit.node, fresh[: hit.host_tokens // self.page_size])
        holder.page_table = list(hit.pages) + fresh
        self.unpin(getattr(holder, "pin", None))  # the hit's lock (taken above) now holds the prefix
        self.hits.device_tokens += hit.device_tokens
        self.hits.host_tokens += hit.host_tokens
        holder.cache_node = hit.node
        holder.num_computed = hit.length
        holder.num_inserted_pages = hit.length // self.page_size
        return True

    def reserve(self, holder: PageHolder, tokens: int) -> bool:
        """Pages for `tokens` of `holder`; False (nothing taken) when even eviction cannot free them."""
        need = self.pages_for(tokens) - len(holder.page_table)
        if not self.make_room(need):
            return False
        if need > 0:
            holder.page_table.extend(self.allocator.alloc(need))
        return True

    def make_room(self, need: int) -> bool:
        """Evict until `need` pages are free. Prefetch pins never block this: when eviction
        alone falls short, every pin is dropped (their prefixes may then be evicted and
        recomputed) and eviction tries again; pinned waiting requests could otherwise hold the
        pool that the one at the head of the queue needs."""
        short = need - self.allocator.num_free
        if short > 0:
            self.tree.evict(short)
            if self.allocator.num_free < need and self.pins:
                for job in list(self.pins):
                    self.unpin(job)
                self.dropped_pins += 1
                self.tree.evict(need - self.allocator.num_free)
        return self.allocator.num_free >= need

    def publish(self, holder: PageHolder) -> None:
        """Put the holder's full pages into the tree once their ids are known (not merely their
        K/V: under overlap the newest ids are placeholders), moving its lock to the deeper node."""
        full = min(holder.num_computed, holder.num_resolved) // self.page_size
        if full <= holder.num_inserted_pages:
            return
        res = self.tree.insert(holder.tokens(0, full * self.page_size), holder.page_table[:full])
        self.tree.lock(res.node)
        if holder.cache_node is not None:
            self.tree.unlock(holder.cache_node)
        holder.cache_node = res.node
        holder.num_inserted_pages = full

    def release(self, holder: PageHolder) -> None:
        """Publish what is full, then drop the holder's lock and every page reference."""
        self.publish(holder)
        if holder.cache_node is not None:
            self.tree.unlock(holder.cache_node)
        self.allocator.decref(holder.page_table)
        holder.page_table = []
        holder.cache_node = None
        holder.num_computed = 0
        holder.num_inserted_pages = 0

    def rollback(self, holder: PageHolder, n: int) -> None:
        """Forget the K/V of the holder's last `n` computed tokens. Their slots stay in its pages
        (rewritten if those tokens run again); published pages cannot be taken back."""
        keep = holder.num_computed - n
        if n < 0 or keep < holder.num_inserted_pages * self.page_size:
            raise ValueError(f"rollback: cannot drop {n} of {holder.num_computed} computed tokens "
                             f"({holder.num_inserted_pages} pages are published)")
        holder.num_computed = keep

    # ---------------------------------------------------------------- transports
    def export(self) -> list[LayerBuffer]:
        """Every KV tensor the model's spec declares, per layer: where it lives and how big a page
        of it is (K and V for attention with heads; one latent for an MLA model)."""
        return [LayerBuffer(layer, name, t.data_ptr(), t.numel() * t.element_size(), t[0].numel() * t.element_size())
                for layer, tensors in enumerate(self.pool.layers) for name, t in tensors.items()]

    # ---------------------------------------------------------------- checks
    def check_invariants(self, holders: Iterable[PageHolder]) -> None:
        """A shadow count of every page's holders (cache/README.md, "Ownership"):

            allocator.refcount(page) == (1 if the tree stores page) + mentions in holders' page tables

        and each node's own locks equal the holders whose `cache_node` it is plus the prefetches
        pinning it (which may pin a host-only prefix; a request's lock is on the device)."""
        refs: Counter[int] = Counter()
        locks: Counter[Node] = Counter()
        for h in holders:
            refs.update(h.page_table)
            if h.cache_node is not None:
                locks[h.cache_node] += 1
        pins = Counter(job.node for job in self.pins)
        locks.update(pins)
        self.allocator.check_invariants()
        if isinstance(self.tree, HiRadixCache):
            self.tree.check_invariants(refs, locks, pins)
        else:
            self.tree.check_invariants(refs, locks)

    def check_idle(self) -> None:
        """Nothing runs: on every tier, every page is free or an unlocked cache page
        (free + cached == total, used == 0)."""
        for tier, u in self.usage().items():
            assert u.free + u.cached + u.used == u.total, f"{tier}: {u} does not add up"
            assert u.used == 0, f"idle, yet {u.used} {tier} pages are held ({u})"

    def host_stats(self) -> HostTierStats:
        host = self.host_pool
        if host is None:
            return HostTierStats()
        assert isinstance(self.tree, HiRadixCache)
        st = host.collect_timings()  # finished loads' GPU-measured copy time; never waits
        return HostTierStats(host.num_pages, host.num_free, st.loaded_bytes, st.saved_bytes,
                             self.tree.host_evicted_pages, self.tree.dropped_pages, st.loaded_seconds,
                             st.saved_seconds, st.load_copy_seconds, st.save_copy_seconds)

    def usage(self) -> dict[str, TierUsage]:
        """Pages per tier, each count taken on its own (a check, and what /metrics will show).
        device: cached = evictable tree pages, used = held by requests or locked nodes;
        host: cached / used = host pages of unlocked / locked nodes (O(tree))."""
        a = self.allocator
        out = {"device": TierUsage(a.num_pages, a.num_free, self.tree.evictable_pages,
                                   sum(1 for c in a.refcounts() if c) - self.tree.evictable_pages)}
        if self.host_pool is not None:
            nodes = self.tree.nodes()
            out["host"] = TierUsage(self.host_pool.num_pages, self.host_pool.num_free,
                                    sum(len(n.host) for n in nodes if n.lock_ref == 0),
                                    sum(len(n.host) for n in nodes if n.lock_ref))
        return out

    # ---------------------------------------------------------------- flush
    def flush(self) -> dict[str, int]:
        """Drop every cache page no holder holds, on every tier (POST /flush_cache: a benchmark
        that starts cold). A holder's locked path stays on the device with its host copies, so
        a running request loses nothing. Returns the pages freed per tier ("host" with the host tier).
        L3 storage is left alone: it may be shared with other replicas and is meant to outlive
        this process (a cold benchmark run points --hicache-storage-url at a fresh store)."""
        host_free = self.host_pool.num_free if self.host_pool is not None else 0
        freed = {"device": self.tree.reset()}
        if self.host_pool is not None:
            freed["host"] = self.host_pool.num_free - host_free
        return freed
