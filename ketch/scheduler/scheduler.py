"""Continuous batching under one token budget per step (no prefill/decode phases).

Each running request catches its `num_computed` up to its length: a decoding request needs
one token, a prefilling one a chunk. A step takes running requests first (in admission
order), then admits waiting ones while budget, pages and `max_num_seqs` allow. When pages run
out, the lowest-priority running request (last admitted) is preempted: its computed pages
go to the prefix cache and it is recomputed later.

Policy only: what a decision means for pages (matching, locking, references, publishing,
eviction) is the KVCacheManager's (cache/manager.py); a request is its page holder.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ketch.cache.manager import KVCacheManager
from ketch.config import EngineConfig
from ketch.scheduler.gate import Gate
from ketch.scheduler.request import FinishReason, Request, RequestState
from ketch.scheduler.request_queue import RequestQueue

LPM_WINDOW = 64  # waiting requests looked at when picking by longest prefix match


@dataclass
class ScheduledChunk:
    req: Request
    num_new: int  # tokens the step runs for it: its own, then the draft's
    draft: list[int] = field(default_factory=list)  # speculative: proposed tokens verified after its last

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits pick a token."""
        return self.req.num_computed + self.num_new - len(self.draft) == self.req.seq_len


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
    def __init__(self, config: EngineConfig, kv: KVCacheManager, storage_gate: Gate | None = None) -> None:
        """storage_gate: with an L3 tier, where a request about to be admitted waits for the pages
        of its prompt that storage holds past the cache (engine/storage_gate.py)."""
        self.config = config
        self.page_size = config.page_size
        self.kv = kv
        self.storage_gate = storage_gate
        self.gates: list[Gate] = []  # where PENDING requests wait (scheduler/gate.py)
        self.waiting = RequestQueue()
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    # ---------------------------------------------------------------- queue
    def add(self, req: Request) -> None:
        req.state = RequestState.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- gates
    def park(self, samples: list[Request], gate: Gate, need: object) -> None:
        """The samples wait at `gate` until `need` is ready (PENDING), then queue as if just added."""
        if gate not in self.gates:
            self.gates.append(gate)
        for req in samples:
            req.state = RequestState.PENDING
            req.gate = gate
        gate.park(samples, need)

    def open_gates(self) -> list[tuple[Request, Exception]]:
        """Queue the samples whose wait ended; the ones whose wait failed end (abort) and are
        returned with the error."""
        failed: list[tuple[Request, Exception]] = []
        for gate in self.gates:
            for samples, error in gate.release():
                for req in samples:
                    if req.state is not RequestState.PENDING:
                        continue  # aborted while parked
                    req.gate = None
                    if error is None and gate is self.storage_gate:
                        req.state = RequestState.WAITING
                        self.waiting.appendleft(req)  # it was at the head, about to be admitted
                    elif error is None and req.page_table:
                        self._run_arrived(req)
                    elif error is None:
                        self.add(req)
                    elif self.finish(req, FinishReason.ABORT):
                        failed.append((req, error))
        return failed

    def _run_arrived(self, req: Request) -> None:
        """Its prompt's KV came with it (a PD decode server: engine/kv_arrival_gate.py): it runs
        from here, decoding, without admission (its pages are its own already)."""
        req.state = RequestState.RUNNING
        req.admitted_once = True
        self.stats.prompt_tokens += len(req.prompt_ids)
        self.running.append(req)

    def has_parked(self) -> bool:
        return any(g.has_parked() for g in self.gates)

    def wait_at_gates(self, timeout: float) -> None:
        """Nothing else to run: sleep until a parked wait ends (or `timeout`)."""
        for gate in self.gates:
            if gate.has_parked():
                gate.wait(timeout)
                return

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
            # a decoding request's draft rides along as far as the budget goes
            draft = req.draft_ids[: min(chunk, budget) - 1] if req.draft_ids and req.num_pending == 1 else []
            n += len(draft)
            reserved, preempted_now = self._reserve(req, req.num_computed + n)
            preempted |= preempted_now
            if reserved:
                out.append(ScheduledChunk(req, n, draft))
                budget -= n
        if not preempted:
            budget = self._admit(out, budget, chunk)
        # decode-like chunks first (verify chunks run as decode rows too): the attention backend batches them
        decode_like = [c for c in out if c.num_new == 1 or c.draft]
        return decode_like + [c for c in out if c.num_new > 1 and not c.draft]

    def _admit(self, out: list[ScheduledChunk], budget: int, chunk: int) -> int:
        for req in self._candidates():
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            hit = self.kv.match(req.all_ids[:-1])  # never covers the last token: its logits are needed
            if self._prefix_in_flight(req, hit.length):
                continue  # another request is computing our next page: wait and hit it in the cache
            if self._wait_for_storage(req):
                continue
            n = min(req.seq_len - hit.length, chunk, budget)
            if not self.kv.admit(req, hit, hit.length + n):
                break
            self.waiting.remove(req)
            req.state = RequestState.RUNNING
            if not req.admitted_once:
                req.admitted_once = True
                # a resumed request's hit may go on into its generated ids: they are not prompt
                req.num_cached_prompt = min(hit.length, len(req.prompt_ids))
                self.stats.prompt_tokens += len(req.prompt_ids)
                self.stats.cached_prompt_tokens += req.num_cached_prompt
            self.running.append(req)
            out.append(ScheduledChunk(req, n))
            budget -= n
        return budget

    def _wait_for_storage(self, req: Request) -> bool:
        """Once per request, when it is about to be admitted: if L3 holds pages of its prompt past
        what the cache holds now, park it while they are read (it then comes back to the head of
        the queue). Asked here rather than on arrival: a queued request's cached prefix erodes
        while it waits, and what matters is the cache at the moment it runs."""
        if self.storage_gate is None or req.storage_checked:
            return False
        req.storage_checked = True
        job = self.kv.prefetch(req.all_ids)
        if job is None:
            return False
        self.waiting.remove(req)
        self.park([req], self.storage_gate, job)
        return True

    def _candidates(self) -> list[Request]:
        """Waiting requests in policy order (a snapshot: admission edits the queue)."""
        if self.config.schedule_policy == "fcfs":
            return list(self.waiting)
        window = list(itertools.islice(self.waiting, LPM_WINDOW))
        return sorted(window, key=lambda r: -self.kv.peek(r.all_ids[:-1]))

    def _prefix_in_flight(self, req: Request, cached: int) -> bool:
        """Is a running request that is still prefilling computing the page right after `req`'s
        cache hit? Then that page reaches the cache within a few steps, and computing it twice is
        waste (the n samples of one prompt, a burst of requests with one system prompt)."""
        if not self.kv.prefix_cache_enabled:
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
    def _reserve(self, req: Request, tokens: int) -> tuple[bool, bool]:
        """Give `req` pages for `tokens`, preempting later requests if needed. (reserved, preempted)"""
        preempted = False
        while not self.kv.reserve(req, tokens):
            victim = self.running[-1]
            self.preempt(victim)
            preempted = True
            if victim is req:
                return False, True
        return True, preempted

    # ---------------------------------------------------------------- transitions
    def preempt(self, req: Request) -> None:
        self.kv.release(req)
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
            self.kv.release(req)
            self.running.remove(req)
        elif req.state is RequestState.WAITING:
            self.waiting.remove(req)
            self.kv.unpin(req.pin)  # never admitted: its prefetch still pins the prefix
        elif req.state is RequestState.PENDING and req.gate is not None:
            req.gate.forget(req)
            req.gate = None
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.matched_stop = matched_stop
        return True

    def after_forward(self, chunks: list[ScheduledChunk]) -> None:
        """Account for the tokens just computed and publish full pages to the prefix cache. A
        draft's K/V counts once the verify keeps it (the engine), never before: pages holding a
        rejected draft are neither computed nor published."""
        for c in chunks:
            c.req.num_computed += c.num_new - len(c.draft)
            self.stats.computed_tokens += c.num_new
            self.kv.publish(c.req)

    def rollback(self, req: Request, n: int) -> None:
        """`req` computed `n` tokens too many (overlap ran it once more after its stop token)."""
        self.kv.rollback(req, n)
