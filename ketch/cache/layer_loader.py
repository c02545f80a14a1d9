"""Host → device loads on a side stream, layer by layer (CUDA), and the per-layer waits of the step.

A hit that is only on the host is copied back into fresh device pages at admission
(`HiRadixCache.load_back` → `HostPool.load`). On CUDA the copies go on a copy stream of their
own, one layer after the other, with an event recorded after each layer; the next forward makes
the compute stream wait for event l just before layer l's attention (runner/layer_waits.py), so
layer 0 computes while later layers' pages are still crossing PCIe:

    copy stream     ─ wait(compute now) ─ start ─ L0 copies ─ ev0 ─ L1 copies ─ ev1 ─ ... ─ end
    compute stream  ─ step in flight ─ embed ─ L0: wait(ev0) attn mlp ─ L1: wait(ev1) attn ... ─

Ordering, hazard by hazard:
- The device pages a load writes come fresh from the allocator; the compute stream may still have
  queued work on them (under overlap scheduling the step in flight used them for a request that
  since finished). The copy stream first waits for the compute stream's current point: nothing
  queued later can hold these pages, so no per-page tracking is needed. The cost: a load starts
  once the step in flight ends (the step that needs it is queued behind that one anyway).
- Whoever reads the loaded pages on the compute stream comes after the next forward, which takes
  the pending waits (`KVPool.take_pending_load`); that forward has waited for every layer's event
  by its last layer, and a later event on one stream implies the earlier ones, so a second load
  before the step just replaces the pending events with its own. A decode step that runs as a
  CUDA graph cannot hold per-layer waits: the runner waits for the whole load before the replay
  (a load comes with an admission, whose prompt tail makes the step an extend step: rare).
- The host rows a load reads belong to a node that keeps them while it is on the device. A host
  page can only be written again after the host pool hands it out anew (`HostPool.alloc`): an L3
  adoption writes it on the host, outside any stream order, so alloc first waits on the host for
  the last load's end event (`fence`): in practice already passed, since the step that waited for
  the load was synchronized by the time results are published. A save (host_saver.py) writes it
  on this same stream, after the load: no fence (`alloc(n, for_save=True)`).
- Staging (the gather plan below, "direct" backend): pinned blocks from torch's caching host
  allocator, which records an event on the copy stream for each asynchronous copy out of a block
  and hands the block out again only after that event completed: a staging buffer is never
  rewritten while its copy is in flight. Device-side scratch (the page ids of a gathered or kernel load) is
  allocated on the copy stream and freed there: reused only by later work on that stream.

Copy plan, chosen per load from the page lists (`page_runs`; measured on an H200, see
`DIRECT_MIN_RUN_BYTES`): host page ids and device page ids often come in ascending runs (both free
lists hand out consecutive ids). A run contiguous on both sides is one DMA straight from the
pinned pool slice into the pool slice: no host copy, no scatter kernel. When runs are short the
launches dominate, and the fragmented load goes by the IO backend chosen at init
(`EngineConfig.hicache_io_backend`, SGLang's `--hicache-io-backend`):
- "direct": the rows are gathered on the host into pinned staging (index_select into a pinned
  buffer: a memcpy at host bandwidth, on the engine thread) and sent as one DMA per tensor, then
  scattered on the device (index_copy_). A plain index_select of pinned rows would give pageable
  memory, whose "non-blocking" copy is a synchronous staged copy: never used here. On a busy
  server the host gather held the engine thread and the load to 13.2 GB/s (H200, PCIe 55 GB/s).
- "kernel": the page ids go up once (one small DMA on the copy stream), then one page-copy
  launch per layer and tensor (ketch/kernels/page_copy.py) reads the rows straight out of the
  pinned pool, which the GPU addresses through unified virtual addressing (host_mapping.py,
  mapped once at init), and writes them into the device pool: no host gather, no staging, the
  engine thread only enqueues the launches. The copies run on SMs beside the step (the DMA
  plans use the copy engines only). The host rows it reads obey the same rules as a DMA's:
  the load's end event covers the kernels, so `fence` is unchanged.

Load bandwidth: a CUDA event pair (start before the first layer, end after the last) per load,
read lazily (`collect_seconds`: only pairs whose end has passed, `Event.query`, no sync), so
loaded bytes over those seconds is the host→device rate the copy stream achieved.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from ketch.cache.kernel_io import KernelIO
from ketch.config import HICACHE_IO_BACKENDS
from ketch.host_copy import to_device

# A load whose runs average at least this many bytes per DMA (run pages x one tensor's page row)
# is copied run by run, straight from the pinned pool; shorter runs are gathered into pinned
# staging first. Measured on an H200 (PCIe Gen5 x16, 16 host cores; benchmarks/hicache_load_cost.py,
# Llama-8B rows of 32 KiB, 1 GiB a load): a torch copy_ costs ~13 us of host time to issue, so
# runs of 1/8/64/512 pages moved 2.6/15.5/51/54 GB/s copied directly, and the gather (torch's
# threaded index_select into pinned memory, pipelined with the DMAs layer by layer) held
# 33-42 GB/s whatever the runs. The two meet near 20 pages (640 KiB) per DMA.
DIRECT_MIN_RUN_BYTES = 1 << 20


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for the maximal stretches of the pairs (src[i], dst[i])
    where both ids go up by one from one pair to the next: each is one contiguous copy."""
    if len(src) != len(dst):
        raise ValueError(f"page_runs: {len(src)} source pages for {len(dst)} destination pages")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def copies_directly(runs: Sequence[tuple[int, int, int]], num_pages: int, row_bytes: int) -> bool:
    """Whether a load of `num_pages` in these runs goes run by run (else: gathered); row_bytes:
    one page of the smallest tensor of a layer (what one page adds to one DMA)."""
    return len(runs) * DIRECT_MIN_RUN_BYTES <= num_pages * row_bytes


class PendingLoad:
    """The per-layer events of the host→device copies the next forward must wait for."""

    def __init__(self, events: list[torch.cuda.Event]) -> None:
        self.events = events

    def wait_layer(self, layer: int) -> None:
        """The current (compute) stream waits for layer `layer`'s copies only."""
        self.events[layer].wait()

    def wait_all(self) -> None:
        """The current stream waits for the whole load (the last layer's event implies the rest)."""
        self.events[-1].wait()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """1-byte element types (fp8) as uint8, the same bytes (index ops have no fp8 on every device)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


class SideStreamLoader:
    """Queues a HostPool's loads on a copy stream of its own, layer by layer (CUDA only).

    io_backend: how a fragmented load copies ("direct": host gather, "kernel": page-copy kernels
    over the mapped pinned pool); fixed here, at init, like every backend choice."""

    def __init__(self, host_layers: list[dict[str, torch.Tensor]], device_layers: list[dict[str, torch.Tensor]],
                 device: torch.device, io_backend: str = "direct") -> None:
        if io_backend not in HICACHE_IO_BACKENDS:
            raise ValueError(f"hicache_io_backend must be {'|'.join(HICACHE_IO_BACKENDS)}, got {io_backend!r}")
        self.host_layers, self.device_layers, self.device = host_layers, device_layers, device
        self.io_backend = io_backend
        # the kernels over the host pool mapped onto the GPU (None: "direct", nothing mapped)
        self.kernel_io = KernelIO(host_layers, device_layers, device) if io_backend == "kernel" else None
        self._fragmented = self._kernel if io_backend == "kernel" else self._gathered
        # high priority: the "kernel" backend's copies are thread blocks that queue for SMs behind a
        # running step's; given priority they go first (H200, multi-turn server run, 2026-12-02:
        # host->device 28.6 -> 43.6 GB/s; DMA engines ignore it)
        self.stream = torch.cuda.Stream(device, priority=-1)
        self.row_bytes = min(t[0].numel() * t.element_size() for t in host_layers[0].values())
        # re-recorded by every load: a wait takes the event's latest record, and a load's event l
        # comes after every earlier load's copies on the same stream
        self.events = [torch.cuda.Event() for _ in device_layers]
        self._timings: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._last_end: torch.cuda.Event | None = None  # the newest load's end, until fenced

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> PendingLoad:
        """Queue the copies of host_pages into device_pages (pairwise), every tensor of every
        layer; returns the events the step reading them waits for, layer by layer."""
        runs = page_runs(host_pages, device_pages)
        copy_layer = self._direct(runs) if copies_directly(runs, len(host_pages), self.row_bytes) \
            else self._fragmented(host_pages, device_pages)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the pages' last users
        with torch.cuda.stream(self.stream):
            start.record()
            for layer, event in enumerate(self.events):
                copy_layer(layer)
                event.record()
            end.record()
        self._timings.append((start, end))
        self._last_end = end
        return PendingLoad(self.events)

    def _direct(self, runs: list[tuple[int, int, int]]) -> Callable[[int], None]:
        """One DMA per run and tensor, straight from the pinned pool into the device pool."""
        def copy_layer(layer: int) -> None:
            dev, host = self.device_layers[layer], self.host_layers[layer]
            for name, h in host.items():
                d = as_bytes(dev[name])
                for s, t, n in runs:
                    d[t:t + n].copy_(as_bytes(h)[s:s + n], non_blocking=True)
        return copy_layer

    def _gathered(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> Callable[[int], None]:
        """Per layer and tensor: gather the rows into pinned staging on the host, one DMA, then
        scatter into the pool on the device. A layer's gather runs while earlier layers' DMAs fly."""
        h_idx = torch.tensor(host_pages, dtype=torch.long)
        with torch.cuda.stream(self.stream):  # the index copy is ordered before the scatters
            d_idx = to_device(device_pages, self.device, torch.long)

        def copy_layer(layer: int) -> None:
            dev, host = self.device_layers[layer], self.host_layers[layer]
            for name, h in host.items():
                src = as_bytes(h)
                stage = torch.empty((len(host_pages), *src.shape[1:]), dtype=src.dtype, pin_memory=True)
                torch.index_select(src, 0, h_idx, out=stage)
                as_bytes(dev[name]).index_copy_(0, d_idx, stage.to(self.device, non_blocking=True))
        return copy_layer

    def _kernel(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> Callable[[int], None]:
        """Per layer and tensor: one page-copy kernel from the mapped pinned pool into the pool."""
        io = self.kernel_io
        assert io is not None
        with torch.cuda.stream(self.stream):  # ordered before the kernels that read them
            h_idx, d_idx = io.page_ids(host_pages, device_pages)
        return lambda layer: io.load_layer(layer, h_idx, d_idx)

    def collect_seconds(self) -> float:
        """Copy-stream seconds of the loads that have finished since the last call (never waits)."""
        seconds = 0.0
        while self._timings and self._timings[0][1].query():
            start, end = self._timings.popleft()
            seconds += start.elapsed_time(end) / 1e3
        return seconds

    def fence(self) -> None:
        """Return once no queued load reads host memory any more (before host rows are rewritten)."""
        if self._last_end is not None:
            self._last_end.synchronize()
            self._last_end = None
