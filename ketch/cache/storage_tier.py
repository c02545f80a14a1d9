"""L3: the storage tier under the host pool — pages written in the background, prefetched for a
request before it is admitted, checked on the way in.

    write   a page gets a host copy (HiRadixCache._copy_to_host) ─▶ a bounded queue ─▶ the writer
            thread takes the page's rows, encodes them (header + checksum, page_codec.py) and
            `set`s it under `PageFormat.key(chained hash)`. A full queue drops the write (counted):
            the engine never waits for storage. Where the rows are taken: on the CPU (saves are
            synchronous) snapshotted on the engine thread at once; on CUDA the save is still on
            the copy stream, so the writer thread waits for its end event, copies the rows, and
            keeps them only if the host page was not handed out again meanwhile (its generation,
            bumped by HostPool.alloc, unchanged: else the copy may be torn; dropped, counted).
    read    a request's prompt goes past what the device and host hold ─▶ `prefetch` starts a job
            on a fetch thread: `exists_prefix` on the keys of the pages after the cached prefix,
            then `get` + `decode_page` of the leading run, in order, appended to the job as they
            arrive. The request waits at a gate (engine/storage_gate.py) until the job ends or
            its deadline passes, then the engine adopts what arrived (KVCacheManager.settle_prefetch)
            as host-only nodes, and admission loads them like any host hit.
    checks  a page that fails decoding (damaged bytes, or another model / dtype / page size /
            layout / rank) ends the run there: it and every page after it (its descendants: their
            K/V attended to it) are not used and are recomputed, and the reason is counted. The
            recomputed page is written again under the same key, replacing the bad one.

Storage holds no page accounting of its own (a key-value store evicts by itself); the pages it
feeds go through the host pool's, which the idle audit checks.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ketch.cache.host_pool import HostPool
from ketch.cache.page_codec import DecodedPage, PageRejected, decode_page, encode_page
from ketch.cache.page_format import PageFormat
from ketch.cache.page_hash import ROOT_HASH, chain_hashes
from ketch.cache.storage.backend import StorageBackend

FETCH_THREADS = 2  # jobs of different requests overlap their round trips; one job reads in order


@dataclass
class StorageTierStats:
    """Counters for /metrics (written by the engine, writer and fetch threads: a count may lag by one)."""

    written_pages: int = 0
    written_bytes: int = 0
    dropped_writes: int = 0  # queue full, or the backend refused the write
    read_pages: int = 0  # fetched and intact
    read_bytes: int = 0
    rejected_corrupt: int = 0  # damaged bytes (checksum, truncation, ...): dropped with what follows
    rejected_foreign: int = 0  # intact, but another model / dtype / page size / layout / rank
    prefetches: int = 0  # requests that waited at the gate for storage
    prefetch_timeouts: int = 0  # ... and were let in by the deadline, with what had arrived
    prefetch_wait_seconds: float = 0.0
    fetch_failures: int = 0  # a read that raised (a bug: logged with its traceback)
    write_failures: int = 0  # a write that raised (a bug, not a backend's I/O failure: logged)
    hit_tokens: int = 0  # prompt tokens adopted from storage (then served through the host tier)
    read_seconds: float = 0.0  # fetch threads: get + decode of the pages read (bytes / seconds: GB/s)
    write_seconds: float = 0.0  # writer thread: encode + set


@dataclass
class WriteItem:
    """One page queued for L3: its rows, or (CUDA) where and when to take them."""

    key: str
    page: int  # the host page
    generation: int  # HostPool.generation[page] when queued
    saved: Any  # the save's end event still in flight when queued (torch.cuda.Event), or None
    rows: list[dict[str, torch.Tensor]] | None  # snapshotted at once (CPU), else taken by the writer


@dataclass(eq=False)  # compared by identity: the pins list holds the jobs themselves
class Prefetch:
    """One request's read: the pages after its cached prefix, fetched in order."""

    tokens: list[int]  # the prompt's whole pages (what the keys name)
    first_page: int  # index of the first page to fetch (the cached prefix's length in pages)
    keys: list[str]
    deadline: float  # time.monotonic() after which the request goes in with what arrived
    started: float
    pages: list[DecodedPage] = field(default_factory=list)  # arrived, intact, in order
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False  # set when the request went in: the fetch thread stops
    node: Any = None  # the radix node of the cached prefix, locked while the read is in flight


class StorageTier:
    def __init__(self, backend: StorageBackend, fmt: PageFormat, host_pool: HostPool,
                 write_queue: int = 1024, prefetch_timeout: float = 1.0) -> None:
        self.backend = backend
        self.format = fmt
        self.host_pool = host_pool
        self.prefetch_timeout = prefetch_timeout
        self.stats = StorageTierStats()
        self._queue: queue.Queue[WriteItem | None] = queue.Queue(write_queue)
        self._writer = threading.Thread(target=self._write_loop, name="ketch-l3-writer", daemon=True)
        self._writer.start()
        self._fetch = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="ketch-l3-fetch")
        # close(), or at interpreter exit for an engine never closed (an LLM script that just ends):
        # the queued pages land and the writer stops before the interpreter tears the threads down
        self._closer = weakref.finalize(self, _stop, self._queue, self._writer, self._fetch, CLOSE_DRAIN_S)

    # ---------------------------------------------------------------- writes
    def save(self, hashes: Sequence[bytes], host_pages: Sequence[int]) -> None:
        """Queue these host pages (named by their chained hashes) for storage; never blocks (on
        CUDA not even for the save that is still writing them: the writer thread waits)."""
        host, deferred = self.host_pool, self.host_pool.saver is not None
        last = host.last_save() if deferred else None
        for page_hash, page in zip(hashes, host_pages, strict=True):
            rows = None if deferred else self._rows(page)
            try:
                self._queue.put_nowait(WriteItem(self.format.key(page_hash), page, host.generation[page], last, rows))
            except queue.Full:
                self.stats.dropped_writes += 1

    def _rows(self, page: int) -> list[dict[str, torch.Tensor]]:
        return [{name: t[page:page + 1].clone() for name, t in layer.items()} for layer in self.host_pool.layers]

    def _take_rows(self, item: WriteItem) -> list[dict[str, torch.Tensor]] | None:
        """The page's rows as saved (writer thread); None when the host page was handed out again."""
        if item.rows is not None:
            return item.rows
        if item.saved is not None:
            item.saved.synchronize()  # the DMA into the page has landed (this thread waits, not the engine)
        rows = self._rows(item.page)
        # seqlock: a new holder bumps the generation before it writes, so unchanged after the copy
        # means nobody wrote the page while it was copied
        return rows if self.host_pool.generation[item.page] == item.generation else None

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            t0 = time.perf_counter()
            try:
                snapshot = self._take_rows(item)
                if snapshot is None:
                    self.stats.dropped_writes += 1
                    continue
                key = item.key
                data = encode_page(snapshot, 0, self.format, key=key)
                ok = self.backend.set(key, data)
                self.stats.write_seconds += time.perf_counter() - t0
                if ok:
                    self.stats.written_pages += 1
                    self.stats.written_bytes += len(data)
                else:
                    self.stats.dropped_writes += 1
            except Exception:  # the writer must outlive a bad page: say so, write on
                self.stats.write_failures += 1
                self.stats.dropped_writes += 1
                traceback.print_exc()
            finally:
                self._queue.task_done()

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the queued writes to land (shutdown, tests); True when they did."""
        return _drain(self._queue, timeout)

    # ---------------------------------------------------------------- reads
    def prefetch(self, prompt_pages: list[int], cached_tokens: int) -> Prefetch | None:
        """Start fetching the pages of `prompt_pages` (whole pages of a prompt, its last token
        excluded) after the first `cached_tokens`; None when there are none to ask for, or a
        local store (the file backend: `local = True`) does not hold the first of them, checked
        here. A network store is never asked on the engine thread (a hung one would stall it):
        the fetch thread finds out, and the request spends a step at the gate."""
        ps = self.format.page_size
        first = cached_tokens // ps
        if first >= len(prompt_pages) // ps:
            return None
        hashes = chain_hashes(ROOT_HASH, prompt_pages, ps)
        if getattr(self.backend, "local", False) and not self.backend.exists(self.format.key(hashes[first])):
            return None  # a new prompt on a local store: one stat, no step spent at the gate
        now = time.monotonic()
        job = Prefetch(prompt_pages, first, [self.format.key(h) for h in hashes[first:]],
                       now + self.prefetch_timeout, now)
        self._fetch.submit(self._read, job)
        return job

    def _read(self, job: Prefetch) -> None:
        try:
            self._read_run(job)
        except Exception:  # a bug, not an I/O failure (backends count those): say so, serve on
            self.stats.fetch_failures += 1
            traceback.print_exc()
        finally:
            job.done.set()

    def _read_run(self, job: Prefetch) -> None:
        present = self.backend.exists_prefix(job.keys)
        for key in job.keys[:present]:
            if job.cancelled:
                return
            t0 = time.perf_counter()
            data = self.backend.get(key)
            if data is None:
                return  # gone since exists_prefix (an LRU store): the run ends here
            try:
                page = decode_page(data, self.format, key=key)
            except PageRejected as e:
                if e.corrupt:
                    self.stats.rejected_corrupt += 1
                else:
                    self.stats.rejected_foreign += 1
                return  # this page and its descendants are recomputed
            self.stats.read_seconds += time.perf_counter() - t0
            self.stats.read_pages += 1
            self.stats.read_bytes += len(data)
            job.pages.append(page)

    def close(self) -> None:
        """Let queued writes land (up to CLOSE_DRAIN_S), then stop the threads; once."""
        self._closer()


CLOSE_DRAIN_S = 5.0  # how long closing waits for queued writes (a dead store: its pages are dropped)


def _drain(writes: queue.Queue, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    with writes.all_tasks_done:
        while writes.unfinished_tasks:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            writes.all_tasks_done.wait(left)
    return True


def _stop(writes: queue.Queue, writer: threading.Thread, fetch: ThreadPoolExecutor, timeout: float) -> None:
    """StorageTier.close's work (no reference to the tier: weakref.finalize runs it at exit too)."""
    _drain(writes, timeout)
    try:
        writes.put_nowait(None)
    except queue.Full:
        pass  # the writer is stuck on a dead store: it is a daemon thread and dies with the process
    else:
        writer.join(timeout)  # out of its last set() before the interpreter finalizes
    fetch.shutdown(wait=False, cancel_futures=True)

