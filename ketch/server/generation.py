"""One HTTP request's generation: its prompts as engine requests, and their outputs as choice events.

    prompts[i] ──▶ engine request "<id>-<i>" ──▶ samples 0..n-1 ──▶ choice i*n + sample

Text (detokenization, stop strings) is made here with ketch.text.SampleText. A sample that hits a
stop string is aborted in the engine at once and reported as finish_reason "stop"; so is one whose
text ends the answer (`answer_end`: the one tool call `parallel_tool_calls: false` allows is
complete), at the token that did, its later tokens neither output nor counted. Leaving early
(client gone, error, cancellation, deadline, shutdown) aborts the unfinished samples with one
message per prompt, so the engine frees their pages. Each sample holds one admission slot until it
ends; `close()` (idempotent, called from every exit path) releases whatever is still held.
An exception put on the request's queue (engine gone, deadline, shutdown) ends it with that error.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import msgspec

from ketch.engine.messages import Bootstrap, RequestError, TokenDelta, WireLogprob
from ketch.engine.validation import validate_request
from ketch.sampling.params import SamplingParams
from ketch.server.client import EngineClient, EngineGone
from ketch.server.errors import APIError, bad_value, engine_unavailable
from ketch.server.pd import TRANSFER_FAILED, transfer_failed
from ketch.server.protocol import REGENERATE_FIELD, RESUME_FIELD, as_sent
from ketch.server.state import ServerState
from ketch.text.sample_text import ReplayedTokens, SampleText


@dataclass
class ChoiceEvent:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[WireLogprob]
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    # text of regenerated tokens its client already has (resume.regenerate_last): never sent, but
    # an output parser takes it so that it stands where the original's did
    silent_text: str = ""


@dataclass
class _Sample:
    text: SampleText
    replay: list[int] = field(default_factory=list)  # regenerated ids still to come (resume.regenerate_last)
    finished: bool = False
    num_tokens: int = 0
    last_token_at: float | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    _seen_prompts: set[str] = field(default_factory=set)
    pd_timing: tuple[float, float, float, float] | None = None  # a PD decode server's TTFT split (seconds)

    def as_dict(self) -> dict:
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens,
               "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.pd_timing is not None:  # ketch's own field: where a PD request's TTFT went (README)
            out["pd_timing"] = {name: round(s * 1e3, 3) if s >= 0 else None
                                for name, s in zip(PD_TIMING, self.pd_timing)}
        return out


PD_TIMING = ("prefill_ms", "transfer_ms", "kv_wait_ms", "first_decode_ms")


def check_context(prompt_ids: list[int], params: SamplingParams, client: EngineClient, param: str,
                  generated: list[int] | None, fields: dict) -> None:
    """The engine's own request checks, made before sending so that a stream can still answer 400;
    `fields`: the request's, to name the fields in the error as the client sent them."""
    ready = client.ready
    assert ready is not None
    try:
        validate_request(prompt_ids, params, vocab_size=ready.vocab_size, max_model_len=ready.max_model_len,
                         kv_capacity=ready.kv_capacity_tokens, prompt_field=param, generated=generated or (),
                         eos_ids=client.eos_token_ids, generated_field=RESUME_FIELD,
                         prefill_only=client.config.disaggregation_mode == "prefill")
    except ValueError as e:
        error = bad_value(e)
        if "exceeds the" in error.message or "the context length is" in error.message:
            error.code = "context_length_exceeded"
        raise as_sent(error, fields) from None


def _resume_named(message: str) -> str:
    """The engine and ketch.text name the resumed ids by their Python name; a client sent them in `resume`."""
    return f"resume.{message}" if message.startswith("generated_token_ids") else message


class Generation:
    """`generated`: a resumed stream's ids so far (one prompt, n = 1; README, "Resuming a stream");
    `replay`: the ids its client has after those, which the engine makes again without their text
    being sent, so that an event the original had cut short (its finish not sent yet) ends here.
    `answer_end`: makes each sample's watch of its text (SampleText's `end`), or None."""

    def __init__(self, state: ServerState, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 timeout: float | None = None, generated: list[int] | None = None,
                 replay: list[int] | None = None, bootstrap: Bootstrap | None = None,
                 answer_end: Callable[[], Callable[[str], bool] | None] | None = None) -> None:
        self.client, self.params = state.client, params
        self.timeout = timeout if timeout is not None else state.request_timeout
        self._admission, self._metrics = state.admission, state.metrics
        self.rids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._prompt_index = {rid: i for i, rid in enumerate(self.rids)}
        self.prompts = dict(zip(self.rids, prompts))
        self.generated = generated
        self.bootstrap = bootstrap  # PD (server/pd.py)
        self.replay = list(replay or ())
        try:
            self.samples = {(rid, j): _Sample(SampleText(state.tokenizer, ids, params, generated or (),
                                                         answer_end() if answer_end else None), list(self.replay))
                            for rid, ids in self.prompts.items() for j in range(params.n)}
        except ValueError as e:  # a resumed text that already holds a stop string (or the last call)
            raise bad_value(_resume_named(str(e))) from None
        self.usage = Usage(prompt_tokens=sum(len(p) for p in prompts))
        self._queue: asyncio.Queue = asyncio.Queue()
        self._started_at = 0.0
        self._admitted = False
        self._deadline: asyncio.TimerHandle | None = None
        self._expired: APIError | None = None  # the deadline passed (_expire)
        self._open = len(self.samples)  # samples not yet ended
        # joining a sample's queued deltas is exact unless a stop string may end it inside the
        # joined run: its tokens after the stop would then count in usage
        self._coalesce = not params.stop

    @property
    def resumed_text(self) -> str:
        """The text the resumed stream's client already has (its first choice's; "" if not resumed)."""
        return next(iter(self.samples.values())).text.resumed_text

    def start(self) -> None:
        """Take admission slots (429 when the queue is full) and send the prompts to the engine."""
        # encode first: a value the wire cannot carry fails here, before a slot is taken
        messages = [(rid, self.client.encode_request(rid, ids, self.params, self.client.origin, self.generated,
                                                         self.bootstrap))
                    for rid, ids in self.prompts.items()]
        try:
            self._admission.acquire(len(self.samples), "n" if self.params.n > 1 else "prompt")
        except APIError as e:
            if e.status == 429:
                self._metrics.rejected.labels(e.code).inc()
            raise
        self._admitted = True
        self._started_at = time.monotonic()
        try:
            for rid, message in messages:
                self.client.add(rid, message, self._queue)
        except BaseException as e:
            self.close()
            if isinstance(e, EngineGone):
                raise engine_unavailable(str(e)) from None
            raise
        if self.timeout is not None:
            self._deadline = asyncio.get_running_loop().call_later(self.timeout, self._expire)

    def _expire(self) -> None:
        """The deadline. The samples end here and now, not when the consumer next reads the queue:
        a stream whose client stopped reading waits in a send for a drain that never comes, and
        its samples would go on generating, holding pages and admission slots. The 408 then
        reaches the consumer, if it ever reads again."""
        self._expired = APIError(408, f"the request ran past its deadline of {self.timeout:g} s and was aborted",
                                 param="timeout", code="request_timeout")
        self.close()
        self._queue.put_nowait(self._expired)  # wakes a consumer waiting for its next delta

    def close(self) -> None:
        """Abort what is unfinished (one message per prompt), release its slots and stop
        listening; safe to call more than once, and before start()."""
        if self._deadline is not None:
            self._deadline.cancel()
        if self._admitted:
            open_rids = {rid for (rid, _), sample in self.samples.items() if not sample.finished}
            for rid in open_rids:
                self.client.abort(rid)  # the engine skips samples that already ended
            for sample in self.samples.values():
                if not sample.finished:
                    self._end(sample, "abort")
        for rid in self.rids:
            self.client.release(rid)

    def _end(self, sample: _Sample, reason: str) -> None:
        sample.finished = True
        self._open -= 1
        self._admission.release()
        self._metrics.finished.labels(reason).inc()
        if reason != "abort":
            self._metrics.e2e.observe(time.monotonic() - self._started_at)

    def _observe_tokens(self, sample: _Sample, count: int) -> None:
        now = time.monotonic()
        if sample.last_token_at is None:
            self._metrics.ttft.observe(now - self._started_at)
        else:
            gap = (now - sample.last_token_at) / count
            for _ in range(count):
                self._metrics.itl.observe(gap)
        sample.last_token_at = now

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Choice events until every sample has ended. What queued up while this request's
        consumer was busy (a slow client, a loaded event loop) is taken at once, a sample's
        deltas joined into one event: a client that falls behind gets several tokens per frame,
        and the per-event costs (detokenizing, parsing, framing) are paid once for them."""
        try:
            while self._open:
                batch = [await self._queue.get()]
                while not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                for item in coalesce(batch) if self._coalesce else batch:
                    if not self._open:
                        break  # all ended: a deadline or shutdown queued behind the last token is moot
                    if isinstance(item, EngineGone):
                        raise engine_unavailable(str(item))
                    if isinstance(item, APIError):  # deadline, shutdown
                        raise item
                    if isinstance(item, RequestError):
                        raise bad_value(_resume_named(item.message))
                    event = self._apply(item)
                    if event is not None:
                        yield event
            if self._expired is not None:  # ended by the deadline while the consumer was away
                raise self._expired
        finally:
            self.close()

    def _apply(self, d: TokenDelta) -> ChoiceEvent | None:
        sample = self.samples.get((d.request_id, d.index))
        if sample is None or sample.finished:
            return None  # e.g. the abort report after a stop string
        if d.error is not None:
            raise transfer_failed(d.error) if d.error.startswith(TRANSFER_FAILED) else bad_value(_resume_named(d.error))
        if d.index == 0 and d.request_id not in self.usage._seen_prompts:
            self.usage._seen_prompts.add(d.request_id)
            self.usage.cached_tokens += d.num_cached_tokens
        if d.pd_timing is not None:
            self.usage.pd_timing = d.pd_timing
        silent, stopped, rest, count = self._replay(sample, d) if sample.replay else ("", None, d, 0)
        text, kept = "", 0
        if rest is not None and stopped is None and not sample.text.ended:
            text, stopped, kept = sample.text.push(rest)  # ids past a stop string's token are not output
        count += kept
        if count:
            self._observe_tokens(sample, count)
        sample.num_tokens += count
        self.usage.completion_tokens += count
        choice = self._prompt_index[d.request_id] * self.params.n + d.index
        event = ChoiceEvent(choice, text, list(rest.new_token_ids[:kept]) if rest else [],
                            list((rest.new_logprobs or [])[:kept]) if rest else [], silent_text=silent)
        if stopped is not None or sample.text.ended:  # a stop string, or the answer's end
            self.client.abort(d.request_id, d.index)
            event.finish_reason, event.matched_stop = "stop", stopped
        elif d.finished:
            event.finish_reason, event.matched_stop = d.finish_reason, d.matched_stop
        if event.finish_reason is not None:
            self._end(sample, event.finish_reason)
        return event

    @staticmethod
    def _replay(sample: _Sample, d: TokenDelta) -> tuple[str, str | None, TokenDelta | None, int]:
        """Take the regenerated ids off the front of `d`: their text (silent), a stop string they
        completed, the rest of `d` (None when nothing is left: `d`'s finish was pushed too), and
        how many of them are output (up to a stop string's token)."""
        n = min(len(sample.replay), len(d.new_token_ids))
        made = list(d.new_token_ids[:n])
        if made != sample.replay[:n]:  # unseeded sampling, or another model: the client's text would fork
            raise APIError(400, f"{REGENERATE_FIELD}: the worker made {made}, not {sample.replay[:n]} as the "
                           f"original stream did, so it cannot continue it", param=REGENERATE_FIELD,
                           code="resume_diverged")
        sample.replay = sample.replay[n:]
        if n == len(d.new_token_ids):
            silent, stopped, kept = sample.text.push(d)
            return silent, stopped, None, kept
        silent, stopped, kept = sample.text.push(ReplayedTokens(made))
        logprobs = None if d.new_logprobs is None else d.new_logprobs[n:]
        rest = msgspec.structs.replace(d, new_token_ids=d.new_token_ids[n:], new_logprobs=logprobs)
        return silent, stopped, rest, kept


def coalesce(items: list) -> list:
    """Join each sample's consecutive token deltas in `items` into one (ids, logprobs in order;
    the last one's finish; a PD first delta's TTFT split kept); anything else (an error, an exception) stays where it was, with the
    deltas before it emitted first."""
    out: list = []
    joined: dict[tuple[str, int], TokenDelta] = {}
    for item in items:
        if not isinstance(item, TokenDelta):
            out.extend(joined.values())
            joined.clear()
            out.append(item)
            continue
        key = (item.request_id, item.index)
        prev = joined.get(key)
        if prev is None:
            joined[key] = item
        elif prev.finished or prev.error is not None:
            out.extend(joined.values())  # nothing follows an end; keep the order as it came
            joined.clear()
            joined[key] = item
        else:
            logprobs = None if prev.new_logprobs is None and item.new_logprobs is None else \
                [*(prev.new_logprobs or ()), *(item.new_logprobs or ())]
            joined[key] = msgspec.structs.replace(
                item, new_token_ids=[*prev.new_token_ids, *item.new_token_ids], new_logprobs=logprobs,
                pd_timing=prev.pd_timing if item.pd_timing is None else item.pd_timing)
    out.extend(joined.values())
    return out
