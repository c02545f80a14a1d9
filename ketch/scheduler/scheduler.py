"""Continuous batching under one token budget per step (no prefill/decode phases).

Each running request catches its `num_computed` up to its length: a decoding request needs
one token, a prefilling one a chunk. A step takes running requests first (in admission
order), then admits waiting ones while budget, pages and `max_num_seqs` allow. When pages run
out, the lowest-priority running request (last admitted) is preempted: its computed pages
go to the prefix cache and it is recomputed later.

Page ownership (see cache/README.md):
    request.page_table  ── one allocator ref per page, held by the request
    request.cache_node  ── radix node locked by the request (its cached prefix)
    radix tree          ── one ref per page in the tree
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from ketch.cache.allocator import PageAllocator
from ketch.cache.radix import RadixCache
from ketch.config import EngineConfig
from ketch.scheduler.request import FinishReason, Request, RequestState

LPM_WINDOW = 64  # waiting requests looked at when picking by longest prefix match


@dataclass
class ScheduledChunk:
    req: Request
    num_new: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits pick a token."""
        return self.req.num_computed + self.num_new == self.req.seq_len


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    cached_prompt_tokens: int = 0  # of which served from the prefix cache
    computed_tokens: int = 0  # tokens run through the model (recomputation included)
    preemptions: int = 0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: PageAllocator, cache: RadixCache) -> None:
        self.config = config
        self.page_size = config.page_size
        self.allocator = allocator
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    # ---------------------------------------------------------------- queue
    def add(self, req: Request) -> None:
        req.state = RequestState.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- one step
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunk = self.config.prefill_chunk
        out: list[ScheduledChunk] = []
        preempted = False
        for req in list(self.running):
            if budget == 0:
                break
            if req.state is not RequestState.RUNNING or req.at_length_limit:
                continue  # preempted earlier in this loop; or done once its in-flight token lands
            n = min(req.num_pending, chunk, budget)
            reserved, preempted_now = self._reserve(req, req.num_computed + n)
            preempted |= preempted_now
            if reserved:
                out.append(ScheduledChunk(req, n))
                budget -= n
        if not preempted:
            budget = self._admit(out, budget, chunk)
        # decode-like chunks first: the attention backend batches them
        return [c for c in out if c.num_new == 1] + [c for c in out if c.num_new > 1]

    def _admit(self, out: list[ScheduledChunk], budget: int, chunk: int) -> int:
        for req in self._candidates():
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            match = self.cache.match(req.all_ids[:-1])  # never covers the last token: its logits are needed
            if self._prefix_in_flight(req, match.length):
                continue  # another request is computing our next page: wait and hit it in the cache
            self.cache.lock(match.node)
            self.allocator.incref(match.pages)
            n = min(req.seq_len - match.length, chunk, budget)
            need = self._pages_for(match.length + n) - len(match.pages)
            if not self._make_room(need):
                self.cache.unlock(match.node)
                self.allocator.decref(match.pages)
                break
            self.waiting.remove(req)
            req.page_table = match.pages + self.allocator.alloc(need)
            req.cache_node = match.node
            req.num_computed = match.length
            req.num_inserted_pages = match.length // self.page_size
            req.state = RequestState.RUNNING
            if not req.admitted_once:
                req.admitted_once = True
                req.num_cached_prompt = match.length
                self.stats.prompt_tokens += len(req.prompt_ids)
                self.stats.cached_prompt_tokens += match.length
            self.running.append(req)
            out.append(ScheduledChunk(req, n))
            budget -= n
        return budget

    def _candidates(self) -> list[Request]:
        """Waiting requests in policy order (a snapshot: admission edits the queue)."""
        if self.config.schedule_policy == "fcfs":
            return list(self.waiting)
        window = list(itertools.islice(self.waiting, LPM_WINDOW))
        return sorted(window, key=lambda r: -self.cache.peek(r.all_ids[:-1]))

    def _prefix_in_flight(self, req: Request, cached: int) -> bool:
        """Is a running request that is still prefilling computing the page right after `req`'s
        cache hit? Then that page reaches the cache within a few steps, and computing it twice is
        waste (the n samples of one prompt, a burst of requests with one system prompt)."""
        if not self.cache.enabled:
            return False
        ps = self.page_size
        if cached + ps > len(req.prompt_ids) - 1:
            return False  # no full page left that the cache could serve
        prefix = req.prompt_ids[: cached + ps]
        return any(
            other.num_computed < len(other.prompt_ids) and other.prompt_ids[: cached + ps] == prefix
            for other in self.running
        )

    # ---------------------------------------------------------------- pages
    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _make_room(self, need: int) -> bool:
        short = need - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
        return self.allocator.num_free >= need

    def _reserve(self, req: Request, tokens: int) -> tuple[bool, bool]:
        """Give `req` pages for `tokens`, preempting later requests if needed. (reserved, preempted)"""
        need = self._pages_for(tokens) - len(req.page_table)
        preempted = False
        while not self._make_room(need):
            victim = self.running[-1]
            self.preempt(victim)
            preempted = True
            if victim is req:
                return False, True
        if need > 0:
            req.page_table.extend(self.allocator.alloc(need))
        return True, preempted

    # ---------------------------------------------------------------- transitions
    def preempt(self, req: Request) -> None:
        self._release(req)
        self.running.remove(req)
        req.state = RequestState.WAITING
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: FinishReason, matched_stop: int | str | None = None) -> bool:
        """End a request exactly once; returns False if it had already ended."""
        if req.state is RequestState.FINISHED:
            return False
        if req.state is RequestState.RUNNING:
            self._release(req)
            self.running.remove(req)
        elif req.state is RequestState.WAITING:
            self.waiting.remove(req)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.matched_stop = matched_stop
        return True

    def after_forward(self, chunks: list[ScheduledChunk]) -> None:
        """Account for the tokens just computed and publish full pages to the prefix cache."""
        for c in chunks:
            c.req.num_computed += c.num_new
            self.stats.computed_tokens += c.num_new
            self._cache_progress(c.req)

    def _cache_progress(self, req: Request) -> None:
        # a page is published once its ids are known, not merely its K/V (overlap: placeholders)
        full = min(req.num_computed, req.num_resolved) // self.page_size
        if full <= req.num_inserted_pages:
            return
        res = self.cache.insert(req.all_ids[: full * self.page_size], req.page_table[:full])
        self.cache.lock(res.node)
        self.cache.unlock(req.cache_node)
        req.cache_node = res.node
        req.num_inserted_pages = full

    def _release(self, req: Request) -> None:
        self._cache_progress(req)
        self.cache.unlock(req.cache_node)
        self.allocator.decref(req.page_table)
        req.page_table = []
        req.cache_node = None
        req.num_computed = 0
        req.num_inserted_pages = 0
