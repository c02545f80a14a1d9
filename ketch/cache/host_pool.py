"""Host pool (L2): a page-granular host-memory mirror of the device KV pool.

Every tensor the device pool holds per layer (the model's `KVSpec`: "k"/"v", or an MLA latent)
has a host twin of the same page shape and element type, [host_pages, page_size, *shape], so a
page moves between tiers as whole rows of every tensor:

    device pool  layers[l][name][device_page]  ──save──▶  host pool  layers[l][name][host_page]
                                               ◀──load──

Host page ids `0..num_pages-1` have their own free list (a `PageAllocator`: each host page has
one holder, the radix node that stores it, so its refcount is 0 or 1). The memory is plain on
the CPU and pinned when the device pool is on CUDA (a pinned buffer is what an asynchronous
host→device copy needs).

Loads: on the CPU a plain copy, done before the step that reads the pages is launched. On CUDA
a side-stream loader (layer_loader.py): the copies are queued on a copy stream layer by layer,
and the device pool's next forward waits, before each layer's attention, for that layer's copies
only. Saves stay synchronous (the tree frees the device pages right after).

The layout is the device's (layer-first, a tensor per layer and name). A page-first layout
(one contiguous object per page, zero-copy to an L3 store) is a later step (issue 15).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ketch.cache.allocator import PageAllocator
from ketch.cache.kv_pool import KVPool
from ketch.cache.layer_loader import SideStreamLoader, as_bytes
from ketch.config import EngineConfig


@dataclass
class HostCopyStats:
    saved_pages: int = 0  # device → host
    loaded_pages: int = 0  # host → device
    saved_bytes: int = 0
    loaded_bytes: int = 0
    saved_seconds: float = 0.0  # wall time of the saves (synchronous: their real duration)
    # host time spent in load(): the copies themselves on the CPU; on CUDA only planning and
    # queueing them (and the host gather of a fragmented load), not their duration
    loaded_seconds: float = 0.0
    # how long the loads' copies took where they ran: the CPU's wall time, or on CUDA the copy
    # stream's own time between events around each load (read once it finished: collect_timings).
    # loaded_bytes over it is the host→device bandwidth
    load_copy_seconds: float = 0.0


class HostPool:
    def __init__(self, device_pool: KVPool, num_pages: int, pin_memory: bool | None = None) -> None:
        """pin_memory: None pins when the device pool is on CUDA."""
        if num_pages < 1:
            raise ValueError(f"hicache_size: the host pool must hold at least one page of "
                             f"{device_pool.bytes_per_page} bytes, got {num_pages} pages")
        self.device_pool = device_pool
        self.num_pages = num_pages
        self.page_size = device_pool.page_size
        self.allocator = PageAllocator(num_pages)
        self.device = device_pool.layers[0][device_pool.spec.names[0]].device
        pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        # empty, not zeros: a host page is read only after a save wrote it
        self.layers: list[dict[str, torch.Tensor]] = [
            {name: torch.empty((num_pages, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for name, t in tensors.items()}
            for tensors in device_pool.layers
        ]
        self.bytes_per_page = device_pool.bytes_per_page
        self.stats = HostCopyStats()
        # CUDA: loads go on a side stream, layer by layer; None on the CPU (plain copies)
        self.loader = SideStreamLoader(self.layers, device_pool.layers, self.device) \
            if self.device.type == "cuda" else None

    # ---------------------------------------------------------------- pages
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.allocator.num_used

    def alloc(self, n: int) -> list[int]:
        """n free host pages (all or nothing: OutOfPages). Their holder writes them on the host, so
        on CUDA a load still reading host rows (maybe these, freed since) must have finished."""
        if self.loader is not None:
            self.loader.fence()
        return self.allocator.alloc(n)

    def free(self, pages: list[int]) -> None:
        """Give host pages back; freeing a free page raises ("released twice")."""
        self.allocator.decref(pages)

    # ---------------------------------------------------------------- copies
    def save(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages into host pages (pairwise), every tensor of every layer.

        Synchronous: the rows are on the host when this returns, so the device pages may be
        reused right after (the tree frees them as it evicts)."""
        if len(device_pages) != len(host_pages):
            raise ValueError(f"save: {len(device_pages)} device pages for {len(host_pages)} host pages")
        if not device_pages:
            return
        t0 = time.perf_counter()
        d_idx = torch.tensor(device_pages, dtype=torch.long, device=self.device)
        h_idx = torch.tensor(host_pages, dtype=torch.long)
        for dev, host in zip(self.device_pool.layers, self.layers, strict=True):
            for name, h in host.items():
                as_bytes(h).index_copy_(0, h_idx, as_bytes(dev[name]).index_select(0, d_idx).to("cpu"))
        self.stats.saved_seconds += time.perf_counter() - t0
        self.stats.saved_pages += len(device_pages)
        self.stats.saved_bytes += len(device_pages) * self.bytes_per_page

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages into device pages (pairwise), every tensor of every layer.

        CPU: plain copies, done when this returns (before the step that reads them is launched).
        CUDA: queued on the loader's copy stream, layer by layer; the device pool's next forward
        waits for layer l's copies before layer l's attention (layer_loader.py)."""
        if len(device_pages) != len(host_pages):
            raise ValueError(f"load: {len(host_pages)} host pages for {len(device_pages)} device pages")
        if not host_pages:
            return
        t0 = time.perf_counter()
        if self.loader is None:
            self._copy_in(host_pages, device_pages)
            self.stats.load_copy_seconds += time.perf_counter() - t0
        else:
            self.device_pool.pending_load = self.loader.load(host_pages, device_pages)
        self.stats.loaded_seconds += time.perf_counter() - t0
        self.stats.loaded_pages += len(host_pages)
        self.stats.loaded_bytes += len(host_pages) * self.bytes_per_page

    def _copy_in(self, host_pages: list[int], device_pages: list[int]) -> None:
        d_idx = torch.tensor(device_pages, dtype=torch.long, device=self.device)
        h_idx = torch.tensor(host_pages, dtype=torch.long)
        for dev, host in zip(self.device_pool.layers, self.layers, strict=True):
            for name, h in host.items():
                as_bytes(dev[name]).index_copy_(0, d_idx, as_bytes(h).index_select(0, h_idx).to(self.device))

    def collect_timings(self) -> HostCopyStats:
        """The stats, with the copy-stream time of every load finished by now added (CUDA: read
        from the loads' events, never waiting for one still in flight)."""
        if self.loader is not None:
            self.stats.load_copy_seconds += self.loader.collect_seconds()
        return self.stats


def host_pages_for(device_pool: KVPool, config: EngineConfig) -> int:
    """Host pages the config asks for: `hicache_size` GB (10^9 bytes, as SGLang) when given,
    else `hicache_ratio` × the device pool's pages."""
    if config.hicache_size is not None:
        return round(config.hicache_size * 1e9) // device_pool.bytes_per_page
    return int(device_pool.num_pages * config.hicache_ratio)
