"""Device → host saves on the loader's copy stream (CUDA): queued, never waited for on the engine thread.

A save copies a node's device pages into its host pages (`HiRadixCache._copy_to_host`:
write_through at insert, write_back at device eviction). Done synchronously (index_select, a
`.to("cpu")` into pageable memory, then index_copy_ into the pinned pool) it ran at 1-1.6 GB/s
on an H200 and held the engine thread for 27 s of a 36 s multi-turn run. Here it is queued on
the copy stream of the loads (layer_loader.py) and returns at once:

    copy stream     ─ wait(compute now) ─ start ─ L0 copies ─ L1 copies ─ ... ─ end(seq)
    compute stream  ─ step in flight ─ ... ─ [wait(end) before a step that may rewrite freed pages]

Ordering, hazard by hazard (the users of each rule are named):
- Device rows may still be written by a step in flight (overlap scheduling: a page is published
  once its ids are known, its K/V maybe a step later): the copy stream first waits for the
  compute stream's current point, as a load does.
- Saves and loads share one stream, so a load of a host page queued after its save reads the
  saved bytes with no further sync, and a save into a host page a queued load still reads is
  ordered after that load.
- Host rows are written by the DMA at some later time. Whoever reads or writes them *on the host*
  first waits for that save's end event: the L3 writer thread (storage_tier.py: in the writer
  thread, never on the engine thread) and `HostPool.alloc` handing a page to a host-side writer
  (an L3 adoption), which waits only when that very page has a save still in flight
  (`SaveLog.wait_pages`, per-page sequence numbers: no per-step stall). A page handed to another
  save is not waited for: the two DMAs are ordered on the stream.
- Device pages freed after a save (device eviction) may be handed to the next step, which would
  rewrite them on the compute stream while the copy stream still reads them: the eviction waits on
  the host for the last save (`HostPool.guard_device_reuse`) before the pages are handed out.
  A wait deferred to the next forward (compute stream waits for the save's event) failed the
  delayed-write_back engine test once in five H200 runs (2026-12-02; cause not found), so the
  simple, certain wait stands until it is. write_through saves free nothing and are never waited
  for.
- Scratch (the index tensors, the gathered staging) is allocated inside the copy stream's context,
  so torch's caching allocator hands those blocks out again only to later work on that stream
  (stream-ordered reuse): no record_stream needed. The pinned index buffer of `to_device` is kept
  by torch's caching host allocator until its copy completed.

Copy plan per save (`page_runs`):
- direct: runs contiguous on both sides and long enough (`copies_directly`, the loads' H200
  threshold, 1 MiB per DMA) go straight from the pool slice into the pinned pool slice;
- else by the IO backend chosen at init (`EngineConfig.hicache_io_backend`, as the loads):
  - "direct", gathered: per layer and tensor, index_select of the device rows into a contiguous
    device staging tensor on the copy stream (a device-bandwidth kernel), then one DMA per *host*
    run from the staging slice into the pinned pool slice. The host allocator hands out
    contiguous runs when it can (`HostPool.alloc` sorts what it takes: a freed node's pages come
    back as one run), so a save is usually one run. Scattered host pages cost one DMA (~13 us of
    host time to issue, measured for loads) per run, layer and tensor; a pinned bounce buffer
    with a host-side scatter after the copy would need every host-side reader and every later
    load to wait for that scatter too, so it is not done: per-run copies keep every hazard a
    stream order.
  - "kernel": the page ids go up once, then one page-copy launch per layer and tensor
    (ketch/kernels/page_copy.py) reads the device rows and writes them straight into the pinned
    pool through its device mapping (host_mapping.py, the loader's, mapped once): no staging,
    one launch whatever the host runs. Its writes to host memory are complete, and visible to
    the host, once the save's end event has passed (kernel completion), so every host-side
    wait above is unchanged.

Timing: an event pair per save, read lazily (`SaveLog.collect_seconds`, `query`, never a sync):
saved bytes over those seconds is the device→host rate.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from ketch.cache.kernel_io import KernelIO
from ketch.cache.layer_loader import as_bytes, copies_directly, page_runs
from ketch.host_copy import to_device


class CopyEvent(Protocol):
    """What SaveLog needs of an event (torch.cuda.Event; a fake in the CPU tests)."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: CopyEvent) -> float: ...


class SaveLog:
    """Which saves are still in flight, per host page; device-independent bookkeeping.

    Every save gets a sequence number; `page_seq[h]` is the number of the last save into host
    page h. Saves finish in order (one stream), so `done` (the newest finished number) tells
    for any page whether its save has landed."""

    def __init__(self, num_host_pages: int) -> None:
        self.page_seq = [0] * num_host_pages
        self.seq = 0  # the newest save's number (0: none yet)
        self.done = 0  # every save up to this number has finished
        self._inflight: deque[tuple[int, CopyEvent, CopyEvent]] = deque()  # (seq, start, end)
        self._seconds = 0.0  # copy time of retired saves, not yet collected

    def add(self, host_pages: Sequence[int], start: CopyEvent, end: CopyEvent) -> int:
        self.seq += 1
        for h in host_pages:
            self.page_seq[h] = self.seq
        self._inflight.append((self.seq, start, end))
        self.retire()  # keeps the queue as short as the saves actually in flight
        return self.seq

    def retire(self) -> None:
        """Move finished saves out of the in-flight queue (event queries, never a wait)."""
        while self._inflight and self._inflight[0][2].query():
            seq, start, end = self._inflight.popleft()
            self._seconds += start.elapsed_time(end) / 1e3
            self.done = seq

    def wait_pages(self, host_pages: Sequence[int]) -> None:
        """Return once no save into any of these host pages is in flight. The common case (their
        last save long finished) costs a max over the pages and no CUDA call."""
        need = max((self.page_seq[h] for h in host_pages), default=0)
        if need <= self.done:
            return
        self.retire()
        for seq, _, end in self._inflight:
            if seq >= need:
                end.synchronize()  # the same stream: this save's end implies every earlier one
                break
        self.retire()

    def last_inflight(self) -> CopyEvent | None:
        """The newest save's end event while it is in flight, else None."""
        self.retire()
        return self._inflight[-1][2] if self._inflight else None

    def collect_seconds(self) -> float:
        """Copy seconds of the saves finished since the last call (never waits)."""
        self.retire()
        seconds, self._seconds = self._seconds, 0.0
        return seconds


class SideStreamSaver:
    """Queues a HostPool's saves on the loader's copy stream (CUDA only).

    kernel_io: the loader's page-copy kernels over the mapped host pool ("kernel" IO backend): a
    fragmented save is then one kernel per layer and tensor into it; None ("direct"): gathered."""

    def __init__(self, stream: torch.cuda.Stream, host_layers: list[dict[str, torch.Tensor]],
                 device_layers: list[dict[str, torch.Tensor]], device: torch.device, row_bytes: int,
                 kernel_io: KernelIO | None = None) -> None:
        self.stream, self.host_layers, self.device_layers = stream, host_layers, device_layers
        self.device, self.row_bytes, self.kernel_io = device, row_bytes, kernel_io
        self._fragmented = self._gathered if kernel_io is None else self._kernel
        self.log = SaveLog(len(next(iter(host_layers[0].values()))))

    def save(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> torch.cuda.Event:
        """Queue the copies of device_pages into host_pages (pairwise); returns the end event."""
        runs = page_runs(device_pages, host_pages)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the rows' last writers
        with torch.cuda.stream(self.stream):
            start.record()
            if copies_directly(runs, len(device_pages), self.row_bytes):
                self._direct(runs)
            else:
                self._fragmented(device_pages, host_pages)
            end.record()
        self.log.add(host_pages, start, end)
        return end

    def _direct(self, runs: list[tuple[int, int, int]]) -> None:
        """One DMA per run and tensor, straight from the pool slice into the pinned pool slice."""
        for dev, host in zip(self.device_layers, self.host_layers, strict=True):
            for name, h in host.items():
                d, hb = as_bytes(dev[name]), as_bytes(h)
                for s, t, n in runs:
                    hb[t:t + n].copy_(d[s:s + n], non_blocking=True)

    def _gathered(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Per layer and tensor: gather the rows on the device into staging, then one DMA per host
        run. Runs inside the copy stream's context (scratch reuse is ordered on it)."""
        d_idx = to_device(device_pages, self.device, torch.long)
        host_runs = page_runs(range(len(host_pages)), host_pages)  # (position, host page, length)
        for dev, host in zip(self.device_layers, self.host_layers, strict=True):
            for name, h in host.items():
                stage = as_bytes(dev[name]).index_select(0, d_idx)
                hb = as_bytes(h)
                for i, t, n in host_runs:
                    hb[t:t + n].copy_(stage[i:i + n], non_blocking=True)

    def _kernel(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Per layer and tensor: one page-copy kernel from the pool into the mapped pinned pool.
        Runs inside the copy stream's context (the ids' upload and reuse are ordered on it)."""
        io = self.kernel_io
        assert io is not None
        d_idx, h_idx = io.page_ids(device_pages, host_pages)
        for layer in range(len(self.device_layers)):
            io.save_layer(layer, d_idx, h_idx)
