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
only. Saves: on the CPU a plain copy; on CUDA queued on the same copy stream (host_saver.py),
never waited for on the engine thread; the hazards that leaves (host readers, reused host pages,
device pages freed right after) are listed there. How CUDA copies fragmented page lists is the
IO backend's, chosen at init (`hicache_io_backend`): "direct" gathers (on the host for loads, on
the device for saves) around DMAs, "kernel" runs page-copy kernels over the pinned pool mapped
onto the GPU (kernel_io.py).

The layout is the device's (layer-first, a tensor per layer and name). A page-first layout
(one contiguous object per page, zero-copy to an L3 store) is a later step (issue 15).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ketch.cache.allocator import PageAllocator
from ketch.cache.host_saver import SideStreamSaver
from ketch.cache.kv_pool import KVPool
from ketch.cache.layer_loader import SideStreamLoader, as_bytes
from ketch.config import EngineConfig
from ketch.host_memory import available_memory_bytes


@dataclass
class HostCopyStats:
    saved_pages: int = 0  # device → host
    loaded_pages: int = 0  # host → device
    saved_bytes: int = 0
    loaded_bytes: int = 0
    # host time spent in save(): the copies themselves on the CPU; on CUDA only queueing them
    saved_seconds: float = 0.0
    # host time spent in load(): the copies themselves on the CPU; on CUDA only planning and
    # queueing them (and the host gather of a fragmented load), not their duration
    loaded_seconds: float = 0.0
    # how long the loads' copies took where they ran: the CPU's wall time, or on CUDA the copy
    # stream's own time between events around each load (read once it finished: collect_timings).
    # loaded_bytes over it is the host→device bandwidth
    load_copy_seconds: float = 0.0
    # the same for saves (CPU: wall time; CUDA: copy-stream events): saved_bytes over it is d2h GB/s
    save_copy_seconds: float = 0.0


class HostPool:
    def __init__(self, device_pool: KVPool, num_pages: int, pin_memory: bool | None = None,
                 io_backend: str = "direct") -> None:
        """pin_memory: None pins when the device pool is on CUDA. io_backend: how the CUDA loads
        and saves copy fragmented page lists ("direct": gathers and DMAs, "kernel": page-copy
        kernels over the pinned pool mapped onto the device; layer_loader.py); the CPU copies in
        place either way."""
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
        self.loader = SideStreamLoader(self.layers, device_pool.layers, self.device, io_backend) \
            if self.device.type == "cuda" else None
        # CUDA: saves on the loader's stream (ordered with the loads), with its kernels; None on the CPU
        self.saver = None if self.loader is None else SideStreamSaver(
            self.loader.stream, self.layers, device_pool.layers, self.device, self.loader.row_bytes,
            self.loader.kernel_io)
        # bumped each time a host page is handed out: a reader off the engine thread (the L3
        # writer) checks it did not change while it copied the page (else the copy may be torn)
        self.generation = [0] * num_pages

    # ---------------------------------------------------------------- pages
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.allocator.num_used

    def alloc(self, n: int, for_save: bool = False) -> list[int]:
        """n free host pages (all or nothing: OutOfPages), in ascending order: pages freed together
        come back as contiguous runs, which a save or load copies with one DMA per run.

        A holder that writes them on the host (an L3 adoption) needs, on CUDA, every queued copy
        touching them finished: the last load (it may read them, freed since) and a save into
        them, waited for only when one of these very pages has one in flight. `for_save`: the
        writer is a save on the copy stream, ordered after both by the stream: no wait."""
        pages = sorted(self.allocator.alloc(n))
        gen = self.generation
        for p in pages:
            gen[p] += 1
        if self.saver is not None and not for_save:
            self.loader.fence()  # type: ignore[union-attr]
            self.saver.log.wait_pages(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Give host pages back; freeing a free page raises ("released twice")."""
        self.allocator.decref(pages)

    # ---------------------------------------------------------------- copies
    def save(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages into host pages (pairwise), every tensor of every layer.

        CPU: synchronous, the rows are on the host when this returns. CUDA: queued on the copy
        stream (host_saver.py); host-side readers wait for `last_save()`, and a caller freeing
        the device pages calls `guard_device_reuse()` after."""
        if len(device_pages) != len(host_pages):
            raise ValueError(f"save: {len(device_pages)} device pages for {len(host_pages)} host pages")
        if not device_pages:
            return
        t0 = time.perf_counter()
        if self.saver is not None:
            self.saver.save(device_pages, host_pages)
        else:
            d_idx = torch.tensor(device_pages, dtype=torch.long, device=self.device)
            h_idx = torch.tensor(host_pages, dtype=torch.long)
            for dev, host in zip(self.device_pool.layers, self.layers, strict=True):
                for name, h in host.items():
                    as_bytes(h).index_copy_(0, h_idx, as_bytes(dev[name]).index_select(0, d_idx).to("cpu"))
            self.stats.save_copy_seconds += time.perf_counter() - t0
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

    def last_save(self) -> torch.cuda.Event | None:
        """The newest save's end event while it is still in flight (CUDA), else None: what a
        host-side reader of the pages it wrote waits for (synchronize, off the engine thread)."""
        return None if self.saver is None else self.saver.log.last_inflight()

    def guard_device_reuse(self) -> None:
        """Device pages a save may still be reading are about to be handed out again: wait for the
        saves in flight. No-op on the CPU and when every save has finished (one event query)."""
        last = self.last_save()
        if last is not None:
            # On the host, not deferred to the next forward: a deferred wait (the compute stream
            # waiting for the save's event) failed the delayed-write_back engine test once in five
            # H200 runs (2026-12-02, cause not found), so a write_back eviction waits here for its
            # save (a pinned DMA, ~25 GB/s) until it is.
            last.synchronize()

    def _copy_in(self, host_pages: list[int], device_pages: list[int]) -> None:
        d_idx = torch.tensor(device_pages, dtype=torch.long, device=self.device)
        h_idx = torch.tensor(host_pages, dtype=torch.long)
        for dev, host in zip(self.device_pool.layers, self.layers, strict=True):
            for name, h in host.items():
                as_bytes(dev[name]).index_copy_(0, d_idx, as_bytes(h).index_select(0, h_idx).to(self.device))

    def collect_timings(self) -> HostCopyStats:
        """The stats, with the copy-stream time of every load and save finished by now added (CUDA:
        read from their events, never waiting for one still in flight)."""
        if self.loader is not None:
            self.stats.load_copy_seconds += self.loader.collect_seconds()
        if self.saver is not None:
            self.stats.save_copy_seconds += self.saver.log.collect_seconds()
        return self.stats


def host_pages_for(device_pool: KVPool, config: EngineConfig, available: int | None = None) -> int:
    """Host pages the config asks for: `hicache_size` GB (10^9 bytes, as SGLang) when given,
    else `hicache_ratio` × the device pool's pages. A ValueError naming the field when they would
    take more than `available` bytes (default: the machine's available memory): the pool's
    memory is taken as pages fill, so too large a pool ran until the OOM killer came."""
    if config.hicache_size is not None:
        field, pages = "hicache_size", round(config.hicache_size * 1e9) // device_pool.bytes_per_page
    else:
        field, pages = "hicache_ratio", int(device_pool.num_pages * config.hicache_ratio)
    if available is None:
        available = available_memory_bytes()
    wanted = pages * device_pool.bytes_per_page
    if wanted > available:
        raise ValueError(f"{field}: the host KV pool would take {wanted / 1e9:.1f} GB, more than the "
                         f"{available / 1e9:.1f} GB of memory available on this machine")
    return pages
