"""The in-process engine: validate and queue requests, run steps, report token deltas.

`ketch.LLM` drives it directly; the engine process (server) drives the same object from its
ZMQ loop. A step is launched — schedule → forward → account computed tokens → sample on the
device, a placeholder appended per sampled token — and later processed: the ids arrive on the
host, replace the placeholders, stop conditions are checked, requests finish (which releases
their pages exactly once).

Overlap scheduling (`overlap_schedule`, the CUDA default) processes step N after launching step
N+1, so the host's scheduling, metadata and stop checks run while the GPU computes; without it
a step is processed right after its launch. Both run the same code; only the order differs:

    overlap off:  launch N ─ process N ─ launch N+1 ─ process N+1 ...
    overlap on:   launch N ─ process N-1 ─ launch N+1 ─ process N ...     (N+1 reads N's ids
                                                                       on the device)
One step late, the scheduler does not yet know which requests step N finished: a request that
sampled a stop token runs one extra row in N+1 whose result is dropped (never one at its
length limit: that is known without the token), and a step whose sampling reads the generated
ids (grammar, penalties) first processes the step in flight. Greedy output is the same either way.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ketch.cache.allocator import PageAllocator
from ketch.cache.radix import RadixCache
from ketch.config import EngineConfig
from ketch.disagg.fake import FakeHub
from ketch.engine import pd
from ketch.engine.build import build_engine
from ketch.engine.messages import Bootstrap
from ketch.engine.engine_checks import audit_if_due, check_engine_invariants
from ketch.engine.engine_stats import engine_stats
from ketch.engine.outputs import EngineOutput, EngineStats, TokenLogprob
from ketch.engine.step_batch import forward_batch
from ketch.engine.tpot_buckets import TPOT_BUCKETS, tpot_bucket
from ketch.engine.validation import validate_bootstrap, validate_request
from ketch.parallel import ParallelContext
from ketch.sampling.params import SamplingParams
from ketch.sampling.counter_rng import fresh_seed
from ketch.sampling.sampler import HostSample, SampleResult, SamplingBatch, SamplingRow, sample_on_device
from ketch.scheduler.request import FinishReason, Request
from ketch.scheduler.scheduler import ScheduledChunk
from ketch.spec.verify import accepted_rows


AUDIT_INTERVAL_S = 5.0  # the idle-time audit runs at most this often (it walks every page and node)
GATE_WAIT_S = 0.01  # an idle step waits this long at a gate (a compile); new requests wait at most this


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; its ids arrive later."""

    # each sampled request, the index in output_ids its (first) token fills, and the draft it
    # verifies: 1 + len(draft) result rows, in this order
    rows: list[tuple[Request, int, list[int]]]
    result: HostSample
    verify: bool = False  # some request verifies a draft: processed before the next step is scheduled
    hidden: Any = None  # `block` speculation: the final hidden states of the result's rows


class Engine:
    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...] = (), fake_hub: FakeHub | None = None,
                 parallel: ParallelContext | None = None) -> None:
        """parallel: a DP-attention rank's context (dp_attention.py); None otherwise."""
        parts = build_engine(config, eos_token_ids, fake_hub, parallel)  # the composition root (build.py)
        self.config = parts.config
        self.source, self.model_config, self.max_model_len = parts.source, parts.model_config, parts.max_model_len
        self.eos_ids = parts.eos_ids
        self._ranks = parts.ranks  # TP > 1: the other ranks (tp_ranks.py)
        self.runner, self.kv, self.scheduler, self.grammars = parts.runner, parts.kv, parts.scheduler, parts.grammars
        self.transport, self.pd_sends, self.kv_gate = parts.transport, parts.pd_sends, parts.kv_gate  # PD (pd.py)
        self.spec = parts.spec  # speculative decoding (speculation.py), None when off
        self.requests: dict[str, list[Request]] = {}  # caller's id → its n samples
        self._arrivals = itertools.count()
        self._aborted: list[EngineOutput] = []
        self._generated_tokens = 0
        self._steps, self._step_seconds = 0, 0.0
        self._decode_seconds = 0.0  # finished requests: first token -> last token, in the engine
        self._decode_intervals = 0  # ... over this many token intervals (each request's n - 1)
        self._tpot_counts = [0] * (len(TPOT_BUCKETS) + 1)  # per-request engine TPOT, non-cumulative
        self._tpot_sum = 0.0
        self.overlap = config.use_overlap_schedule
        self.audits = self.audit_failures = 0
        self._audited_at, self._audited_at_step = 0.0, 0
        self._in_flight: LaunchedStep | None = None  # overlap: launched, not yet processed

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def allocator(self) -> PageAllocator:
        return self.kv.allocator

    @property
    def cache(self) -> RadixCache:
        return self.kv.tree

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    generated_token_ids: Sequence[int] = (), bootstrap: Bootstrap | None = None) -> None:
        """Queue a request; raises ValueError naming the field for bad input (the engine is unchanged).

        `generated_token_ids` resumes a stream another worker began (README, "Resuming a stream"):
        they are its first outputs, prefilled after the prompt, and it goes on from there.
        `bootstrap`: PD disaggregation (pd.py): required on a prefill or decode engine."""
        self.validate(request_id, prompt_ids, params, generated_token_ids)
        b = bootstrap
        validate_bootstrap(self.config.disaggregation_mode, b and b.host, b and b.port, b and b.room, params,
                           generated_token_ids)
        samples: list[Request] = []
        for i in range(params.n):
            # sample i of a seeded request draws from seed + i, so the n samples differ
            seed = fresh_seed() if params.seed is None else params.seed + i
            req = Request(
                rid=request_id if params.n == 1 else f"{request_id}#{i}",
                group_id=request_id,
                index=i,
                prompt_ids=list(prompt_ids),
                params=params,
                seed=seed,
                eos_ids=self.eos_ids,
                max_len=self.max_model_len,
                arrival=next(self._arrivals),
                output_ids=list(generated_token_ids),
                num_resumed=len(generated_token_ids),
            )
            samples.append(req)
        self.requests[request_id] = samples
        if bootstrap is not None and pd.start(self, samples[0], bootstrap):
            return  # a decode engine's request waits at the KV arrival gate
        if params.grammar is not None:
            self.scheduler.park(samples, self.grammars, params.grammar)  # schedulable once it compiles
            return
        for req in samples:
            self.scheduler.add(req)

    def validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 generated: Sequence[int] = ()) -> None:
        """add_request's checks without adding (a DP-attention front checks here for every rank)."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        validate_request(prompt_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                         kv_capacity=self.kv.capacity_tokens, generated=generated, eos_ids=self.eos_ids,
                         prefill_only=self.config.disaggregation_mode == "prefill")
        if params.grammar is not None:
            self.grammars.check(params.grammar)

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort a request (or one of its samples) in any state; a no-op once it has ended."""
        samples = self.requests.get(request_id, [])
        if index is not None:  # stored in index order: one sample is a lookup, not a scan of n
            samples = samples[index:index + 1] if index >= 0 else []
        for req in samples:
            if self.pd_sends is not None:
                pd.abort_send(self, req)
            if self.scheduler.finish(req, FinishReason.ABORT):
                self._aborted.append(self._output(req, [], None))
        if samples:
            self._forget(samples[0])  # once for the group, not once per sample (n × n)

    def flush_cache(self) -> dict[str, int]:
        """Empty the prefix cache of every page no running request holds, on every tier; the
        pages freed per tier. Called between steps: a running (or mid-prefill) request has its
        published path locked and the rest of its pages in its page table, so it runs on as if
        nothing happened; a waiting one holds nothing yet and simply finds no hit."""
        return self.kv.flush()

    def close(self) -> None:
        """Stop the tensor-parallel workers (TP > 1) and let queued L3 writes land; idempotent."""
        if self._ranks:
            self._ranks.close()
        if self.kv.storage is not None:
            self.kv.storage.close()
        if self.transport is not None:
            self.transport.close()

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_work() or bool(self._aborted) or self.scheduler.has_parked()
                or self._in_flight is not None or (self.pd_sends is not None and self.pd_sends.has_work()))

    def stats(self) -> EngineStats:
        """A snapshot for /metrics: queue sizes, page accounting and token counters."""
        return engine_stats(self)

    # ---------------------------------------------------------------- step
    def step(self) -> list[EngineOutput]:
        t0 = time.perf_counter()
        outputs = self._step()
        self._steps += 1
        self._step_seconds += time.perf_counter() - t0
        return outputs

    def _step(self) -> list[EngineOutput]:
        outputs, self._aborted = self._aborted, []
        for req, error in self.scheduler.open_gates():
            outputs.append(self._output(req, [], None, error=str(error)))
            self._forget(req)
        if self.transport is not None:
            outputs += pd.outputs(self)
        if self.spec is not None:
            outputs += self._draft()
        chunks = self.scheduler.schedule()
        if self._in_flight is not None and any(c.req.needs_history for c in chunks):
            # this step's sampling reads ids still in flight: take them first
            outputs += self._process(self._in_flight)
            self._in_flight = None
            chunks = [c for c in chunks if not c.req.is_finished]
        launched = self._launch(chunks) if chunks else None
        if self.overlap:
            launched, self._in_flight = self._in_flight, launched
        if launched is not None:
            outputs += self._process(launched)
        elif not chunks and not outputs and self._in_flight is None:
            pd.idle(self, GATE_WAIT_S)  # only parked requests (or PD transfers) are left: don't spin
        if not chunks and self.spec is not None:
            self.spec.idle()
        return outputs

    def _draft(self) -> list[EngineOutput]:
        """Drafts for this step if the cost model wants them (they extend the known ids, so a step in
        flight is processed first; a verify step always, its yield is not yet known)."""
        outputs: list[EngineOutput] = []
        step = self._in_flight
        wants = self.spec.wants_drafts(self.scheduler.running)
        if step is not None and (wants or step.verify):
            self._in_flight = None
            outputs = self._process(step)
        if wants:
            self.spec.propose(self.scheduler.running)
        return outputs

    def _launch(self, chunks: list[ScheduledChunk]) -> LaunchedStep | None:
        """Queue the step's forward and sampling; nothing here waits for the device."""
        sampled = [c for c in chunks if c.samples]  # before after_forward moves num_computed
        sampling = [c.req for c in sampled]
        batch = forward_batch(chunks, self.config.page_size)
        if self._ranks:
            self._ranks.send_step(batch)  # every rank runs this forward
        logits = self.runner.forward(batch)
        self.scheduler.after_forward(chunks)
        if self.pd_sends is not None:  # pipelining: the prompt pages this step filled may move now
            self.pd_sends.progress([c.req for c in chunks], logits.device)
        verify = any(c.draft for c in chunks)
        if self.spec is not None:
            decode_only = len(sampled) == len(chunks) and all(c.num_new - len(c.draft) == 1 for c in chunks)
            self.spec.launched(len(chunks), batch.num_tokens, decode_only, verify)
        if not sampling:
            return None  # prefill chunks only: no token this step
        rows: list[SamplingRow] = []
        for c in sampled:
            r = c.req
            rows += self.spec.rows(r, c.draft) if c.draft else \
                [SamplingRow(r.params, r.seed, r.output_ids, r.prompt_ids, len(r.output_ids), r.eos_ids, r.grammar)]
        result = sample_on_device(logits, SamplingBatch.build(rows, self.vocab_size, logits.device))
        if verify:  # processed before the next step is scheduled: its ids never go through the device buffer
            placeholders = [-1] * len(sampling)
        else:
            if self._ranks:
                self._ranks.send_sampled(result.token_ids)  # the workers publish them as below, in step
            placeholders = self.runner.future.publish(result.token_ids)
        filled: list[tuple[Request, int, list[int]]] = []
        for c, placeholder in zip(sampled, placeholders):
            filled.append((c.req, len(c.req.output_ids), c.draft))
            c.req.output_ids.append(placeholder)
            c.req.num_unresolved += 1
        return LaunchedStep(filled, result.start_copy(), verify, self.runner.last_hidden if self.runner.keep_hidden else None)

    def _process(self, step: LaunchedStep) -> list[EngineOutput]:
        """The launched step's ids are on the host: fill them in, check stops, report."""
        result = step.result.wait()
        now = time.perf_counter()  # when these tokens reached the host: the engine's token clock
        outputs: list[EngineOutput] = []
        end = 0
        for req, index, draft in step.rows:
            first, end = end, end + len(draft) + 1
            if req.is_finished:
                continue  # aborted, or stopped by its previous token while this one was in flight
            kept = accepted_rows(draft, result.token_ids[first:end]) if draft else 1
            if step.verify:
                self.spec.yielded(len(draft), kept)
            if step.hidden is not None:
                req.last_hidden = step.hidden[first + kept - 1]  # the row of its last token
            tokens, logprobs = self._take(req, index, result, first, kept, now)
            if tokens is None:
                continue  # PD prefill: its answer waits for the decode side
            outputs.append(self._output(req, tokens, logprobs, error=req.error))
            if req.is_finished:
                self._count_decode(req, now)
                self._forget(req)
        return outputs

    def _take(self, req: Request, index: int, result: SampleResult, first: int, kept: int,
              now: float) -> tuple[list[int] | None, list[TokenLogprob] | None]:
        """Output the `kept` tokens of rows first.. (a verify keeps 1 + its accepted drafts) until a
        stop; the tokens and their logprobs."""
        tokens: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if req.params.wants_logprobs else None
        for j in range(kept):
            token, row = result.token_ids[first + j], first + j
            if j == 0:
                req.output_ids[index] = token
                req.num_unresolved -= 1
            else:  # the draft before it was kept: its K/V (run in the verify) now counts
                req.output_ids.append(token)
                req.num_computed += 1
            self._generated_tokens += 1
            if logprobs is not None:
                top = list(zip(result.top_ids[row], result.top_logprobs[row]))[: req.params.top_logprobs] if result.top_ids else []
                logprobs.append(TokenLogprob(token, result.logprobs[row], top))
            if index + j == req.num_resumed:  # the first token this engine made
                req.first_token_at = now
            if self.pd_sends is not None and req.rid in self.pd_sends.sends:
                pd.send_first(self, req, token, logprobs, index + 1)  # its answer waits for the decode side
                return None, None
            tokens.append(token)
            self._check_stop(req, token, index + 1 + j)
            if req.is_finished:
                if req.error is not None:  # the token its grammar refused (and its logprob) is not output
                    tokens, logprobs = tokens[:-1], (logprobs[:-1] if logprobs else logprobs)
                return tokens, logprobs
        if kept > 1:
            self.kv.publish(req)  # the kept drafts may have filled pages
        return tokens, logprobs

    def _count_decode(self, req: Request, now: float) -> None:
        """The engine's side of TPOT: a finished request's time from its first to its last token
        over its n - 1 intervals, i.e. the mean step while it decoded, prompt-only steps excluded."""
        made = len(req.output_ids) - req.num_resumed  # a resumed stream's first tokens came from elsewhere
        if made > 1:
            seconds, intervals = now - req.first_token_at, made - 1
            self._decode_seconds += seconds
            self._decode_intervals += intervals
            self._tpot_counts[tpot_bucket(seconds / intervals)] += 1
            self._tpot_sum += seconds / intervals

    def _check_stop(self, req: Request, token: int, num_output: int) -> None:
        """`token` is output number `num_output`; later ones may be in flight (overlap)."""
        p = req.params
        if req.grammar is not None:
            # accept() fails only when the mask allowed nothing (a grammar that dead-ends: `x ::= x`)
            # and the sampler fell back to a token: not output; the sample ends with an error. A
            # complete grammar allows only stop tokens, and accepting one terminates it.
            if not req.grammar.accept(token):
                req.error = (f"{p.grammar.kind}: the grammar allows no token after {num_output - 1} generated tokens "
                             f"(no text it matches continues them)")
                self._finish(req, num_output - 1, FinishReason.ABORT)
                return
            if req.grammar.is_terminated():
                self._finish(req, num_output, FinishReason.STOP, token)
                return
        is_stop_token = token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_ids)
        if is_stop_token and num_output >= p.min_tokens:
            self._finish(req, num_output, FinishReason.STOP, token)
        elif num_output >= p.max_tokens or len(req.prompt_ids) + num_output >= req.max_len:
            self._finish(req, num_output, FinishReason.LENGTH)

    def _finish(self, req: Request, num_output: int, reason: FinishReason, stop: int | None = None) -> None:
        """End `req` after its output number `num_output`. A step launched after that one
        (overlap) may have run it once more: drop that token and count its K/V as not computed,
        so pages and the prefix cache end exactly as without overlap."""
        if len(req.output_ids) > num_output:
            del req.output_ids[num_output:]
            req.num_unresolved = 0
            extra = req.num_computed - (req.seq_len - 1)  # the dropped token's K/V, if it ran
            if extra > 0:
                self.scheduler.rollback(req, extra)
        self.scheduler.finish(req, reason, stop)

    @staticmethod
    def _output(req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None,
                error: str | None = None) -> EngineOutput:
        return EngineOutput(request_id=req.group_id, index=req.index, new_token_ids=tokens, new_logprobs=logprobs,
                            finished=req.is_finished, finish_reason=req.finish_reason.value if req.finish_reason else None,
                            matched_stop=req.matched_stop, num_prompt_tokens=len(req.prompt_ids),
                            num_cached_tokens=req.num_cached_prompt, error=error)

    def _forget(self, req: Request) -> None:
        samples = self.requests.get(req.group_id)
        if samples is not None and all(r.is_finished for r in samples):
            del self.requests[req.group_id]

    def _holders(self) -> list:
        """Every page holder besides the tree: running requests, and PD transfers' page holds."""
        return [*self.scheduler.running, *pd.holds(self)]

    # ---------------------------------------------------------------- checks
    def audit_if_due(self) -> None:
        """The idle-time audit, at most once per AUDIT_INTERVAL_S after steps ran (engine_checks.py)."""
        audit_if_due(self, AUDIT_INTERVAL_S)

    def check_invariants(self) -> None:
        """Every page-holding invariant of the engine (engine_checks.py); raises AssertionError."""
        check_engine_invariants(self)
