"""The KV manager's side of the L3 tier (cache/storage_tier.py): start a prompt's prefetch with
its cached prefix pinned, adopt what arrived into the host tier, unpin at admission, and the
tier's counters for /metrics. A mixin of KVCacheManager (manager.py), kept apart so each file
holds one idea; it uses the manager's tree, host pool, storage and pins.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ketch.cache.hiradix import HiRadixCache
from ketch.cache.page_codec import load_page
from ketch.cache.storage_tier import Prefetch

if TYPE_CHECKING:
    from ketch.cache.host_pool import HostPool
    from ketch.cache.radix import RadixCache
    from ketch.cache.storage_tier import StorageTier


class StorageReads:
    tree: RadixCache
    host_pool: HostPool | None
    storage: StorageTier | None
    pins: list[Prefetch]
    page_size: int

    def prefetch(self, prompt_ids: list[int]) -> Prefetch | None:
        """Start reading from L3 the pages of the prompt past what the device and host hold now
        (the scheduler asks when the request is about to be admitted; None: no L3 tier, nothing
        past them, or the store lacks the first). The last prompt token is never part of a hit.
        The cached prefix is pinned (locked) until the request is admitted or ends: the pages
        read are its continuation, and a prefix evicted meanwhile would leave them behind a gap."""
        if self.storage is None:
            return None
        whole = (len(prompt_ids) - 1) // self.page_size * self.page_size
        tokens = prompt_ids[:whole]
        cached = self.tree.peek(tokens)
        job = self.storage.prefetch(tokens, cached)
        if job is not None:
            job.node = self.tree.match(tokens[:cached]).node  # covers exactly the cached prefix
            self.tree.lock(job.node)
            self.pins.append(job)
        return job

    def settle_prefetch(self, job: Prefetch) -> int:
        """The read ended (or its deadline passed): what arrived joins the host tier, and the pin
        moves down onto it. It stays until the request is admitted (`admit` unpins: the request
        goes back to the head of the queue, so that is the next step) or ends (`unpin`).
        Returns tokens adopted."""
        adopted, end = self._adopt(job)
        if adopted and job in self.pins:  # (make_room may have dropped the pin meanwhile)
            # down to the end of what was inserted: the tree may have grown past first_page while
            # the read was in flight, so the pages adopted start after that, not at first_page
            deeper = self.tree.match(job.tokens[:end]).node
            self.tree.lock(deeper)
            self.tree.unlock(job.node)
            job.node = deeper
        return adopted

    def unpin(self, job: Prefetch | None) -> None:
        """Drop a prefetch's pin (idempotent: the n samples of a request share one)."""
        if job is not None and job in self.pins:
            self.tree.unlock(job.node)
            self.pins.remove(job)

    def _adopt(self, job: Prefetch) -> tuple[int, int]:
        """Put the pages a prefetch brought into the host tier as host-only nodes after the
        prompt's cached prefix (pinned, so at least as long as when the read began; pages it
        has since covered are skipped). Host room is made by host LRU; returns (tokens adopted,
        the prompt tokens the tree holds through them)."""
        ps, arrived = self.page_size, list(job.pages)
        if not arrived:
            return 0, 0
        assert isinstance(self.tree, HiRadixCache) and self.host_pool is not None
        m = self.tree.match(job.tokens[: (job.first_page + len(arrived)) * ps])
        have = m.length // ps
        use = arrived[have - job.first_page:] if have >= job.first_page else []  # a gap: unusable
        if not use:
            return 0, 0
        self.tree.lock(m.node)
        try:
            short = len(use) - self.host_pool.num_free
            if short > 0:
                self.tree.evict_host(short)
            n = min(len(use), self.host_pool.num_free)
            if n:
                host = self.host_pool.alloc(n)
                for page, h in zip(use, host):
                    load_page(self.host_pool.layers, h, page)
                self.tree.insert_host(job.tokens[: (have + n) * ps], host)
        finally:
            self.tree.unlock(m.node)
        assert self.storage is not None
        self.storage.stats.hit_tokens += n * ps
        return n * ps, (have + n) * ps

    def storage_stats(self) -> dict[str, int | float | bool]:
        """The L3 tier's counters as EngineStats fields ({} without it)."""
        if self.storage is None:
            return {}
        st, backend = self.storage.stats, self.storage.backend.stats
        return dict(storage_enabled=True, storage_hit_tokens=st.hit_tokens, storage_read_bytes=st.read_bytes,
                    storage_written_bytes=st.written_bytes, storage_written_pages=st.written_pages,
                    storage_read_seconds=st.read_seconds, storage_write_seconds=st.write_seconds,
                    storage_dropped_writes=st.dropped_writes, storage_rejected_corrupt=st.rejected_corrupt,
                    storage_rejected_foreign=st.rejected_foreign,
                    storage_errors=backend.errors, storage_read_errors=backend.read_errors,
                    storage_stale_temps_removed=backend.stale_temps_removed,
                    storage_prefetches=st.prefetches, storage_prefetch_timeouts=st.prefetch_timeouts,
                    storage_prefetch_wait_seconds=st.prefetch_wait_seconds)
