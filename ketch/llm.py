"""The offline API: `LLM(...).generate / chat / stream`, driving the engine in-process.

Text concerns live here, above the engine: tokenizing, chat templates, incremental
detokenization and stop strings. A sample that hits a stop string is aborted in the engine
(its pages return at once) and reported with finish_reason "stop".
"""
from __future__ import annotations

import itertools
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from tqdm import tqdm

from ketch.config import EngineConfig
from ketch.engine.factory import make_engine
from ketch.engine.outputs import EngineOutput, TokenLogprob
from ketch.sampling.params import SamplingParams
from ketch.text.chat_template import ChatTemplate
from ketch.text.sample_text import SampleText as _SampleText
from ketch.text.tokenizer import Tokenizer
from ketch.weights.source import ModelSource

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


@dataclass
class RequestOutput:
    """One prompt's result; `text`, `token_ids`, `finish_reason`, `logprobs` are those of sample 0."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


class _TextStream(Iterator[str]):
    """stream()'s iterator: its deltas, and its request's end when it is closed or dropped. A
    generator's own `finally` runs only once it has started: a stream dropped unread would leave its
    request decoding (pages held) inside every later call. Dropped, it is noted (a finalizer may run
    in the middle of an engine step, so it only notes) and aborted before the LLM's next step."""

    def __init__(self, llm: LLM, rid: str, deltas: Iterator[str]) -> None:
        self._llm, self._rid, self._deltas = llm, rid, deltas
        self._dropped = weakref.finalize(self, llm._dropped.append, rid)

    def __next__(self) -> str:
        try:
            return next(self._deltas)
        except StopIteration:
            self._dropped.detach()  # ended: the generator released the request
            raise

    def close(self) -> None:
        self._dropped.detach()
        self._deltas.close()  # type: ignore[attr-defined]
        self._llm._release(self._rid)


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", **engine_args: Any) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, **engine_args)
        source = ModelSource.resolve(model, self.config.load_format, self.config.tokenizer).tokenizer
        self.tokenizer = None if source is None else Tokenizer.load(source)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else ()
        self.engine = make_engine(self.config, eos)
        self.config = getattr(self.engine, "config", self.config)  # "auto" resolved (runner/cpu_dtype.py)
        self._ids = itertools.count()
        self._template: ChatTemplate | None = None
        # each open request's undelivered outputs: generate() calls and open stream() iterators
        # step the one engine in turn, and a step's outputs belong to whichever asked (_pump)
        self._inbox: dict[str, deque[EngineOutput]] = {}
        self._dropped: list[str] = []  # streams dropped unread (_TextStream): aborted at the next step
        self._closed = False

    # ---------------------------------------------------------------- public API
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """params: one for every prompt, or a list with one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, Sequence):
            raise ValueError(f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}")
        return self._run([self._encode(p) for p in prompts], self._per_prompt(params, len(prompts)), use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool = False, chat_template: str | None = None) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.encode_chat(c, chat_template) for c in conversations]
        return self._run(prompts, self._per_prompt(params, len(prompts)), use_tqdm)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               generated_token_ids: Sequence[int] = ()) -> Iterator[str]:
        """Text deltas of one prompt's first sample as they are decoded. Bad input raises here,
        not at the first `next()`. Open streams and generate() calls of this LLM may interleave
        (one thread): each gets its own outputs whoever steps the engine. `generated_token_ids`
        resumes a stream that produced them (engine README, "Resuming a stream"): the deltas
        continue its text."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("n: stream() takes n == 1")
        if self.tokenizer is None:
            raise ValueError("prompt: stream() yields text and this model has no tokenizer; generate() gives "
                             "token ids")
        ids = self._encode(prompt)
        rid = self._add(ids, params, generated_token_ids)
        try:
            text = _SampleText(self.tokenizer, ids, params, generated_token_ids)
        except ValueError:
            self._release(rid)
            raise
        return _TextStream(self, rid, self._stream(rid, text))

    def _stream(self, rid: str, text: _SampleText) -> Iterator[str]:
        box = self._inbox[rid]
        try:
            while True:
                while box:
                    out = box.popleft()
                    if out.error is not None:
                        raise ValueError(out.error)
                    delta, stopped, _ = text.push(out)
                    if delta:
                        yield delta
                    if stopped is not None or out.finished:
                        return
                self._pump()
        finally:
            self._release(rid)

    def flush_cache(self) -> dict[str, int]:
        """Empty the prefix cache (and the host tier, with the hierarchical cache) so the next
        request starts cold; pages freed per tier. A prompt still streaming through `stream()`
        keeps the pages it holds and its output."""
        return self.engine.flush_cache()

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers (tensor_parallel_size > 1; they also stop at
        interpreter exit); the LLM is unusable afterwards: a new request raises."""
        self._closed = True
        self.engine.close()

    def encode_chat(self, messages: list[dict], chat_template: str | None = None) -> list[int]:
        tok = self._require_tokenizer()
        if chat_template:
            template = ChatTemplate(chat_template)
        elif tok.chat_template:
            if self._template is None:
                self._template = ChatTemplate(tok.chat_template)  # compile the model's template once
            template = self._template
        else:
            raise ValueError("chat_template: the model has none; pass chat_template=")
        text = template.render(messages, add_generation_prompt=True, bos_token=tok.bos_token, eos_token=tok.eos_token)
        return tok.encode(text, add_special_tokens=False)

    # ---------------------------------------------------------------- internals
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids")
        return self.tokenizer

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return self._require_tokenizer().encode(prompt)
        return list(prompt)

    def _add(self, prompt_ids: list[int], params: SamplingParams, generated: Sequence[int] = ()) -> str:
        if self._closed:  # its L3 threads are stopped: a read failed mid-step, writes were lost
            raise RuntimeError("LLM: close() was called; this LLM takes no more requests (make a new LLM)")
        rid = f"llm-{next(self._ids)}"
        self.engine.add_request(rid, prompt_ids, params, generated)
        self._inbox[rid] = deque()
        return rid

    def _release(self, rid: str) -> None:
        self._inbox.pop(rid, None)
        self.engine.abort(rid)

    def _pump(self) -> set[str]:
        """One engine step, its outputs put in their requests' inboxes (outputs of requests no
        longer open are dropped); the ids that got one. A step that runs nothing while a caller
        still waits would spin forever: that is an error instead."""
        while self._dropped:
            self._release(self._dropped.pop())
        if not self.engine.has_unfinished():
            raise RuntimeError("engine: nothing left to run, but a request of this LLM has not finished")
        got = set()
        for out in self.engine.step():
            box = self._inbox.get(out.request_id)
            if box is not None:
                box.append(out)
                got.add(out.request_id)
        return got

    @staticmethod
    def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * count
        if not isinstance(params, Sequence) or len(params) != count or \
                not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"params: one SamplingParams, or a list of one per prompt ({count}), got {params!r:.80}")
        return list(params)

    def _run(self, prompts: list[list[int]], all_params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        for params in all_params:
            params.validate(self.engine.vocab_size)
        results: dict[str, RequestOutput] = {}
        texts: dict[tuple[str, int], _SampleText] = {}
        try:
            for ids, params in zip(prompts, all_params, strict=True):
                rid = self._add(ids, params)
                results[rid] = RequestOutput(rid, ids, [CompletionOutput(i) for i in range(params.n)])
                for i in range(params.n):
                    texts[rid, i] = _SampleText(self.tokenizer, ids, params)
            bar = tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm)
            pending = len(results)
            while pending:
                for rid in self._pump().intersection(results):
                    res, box = results[rid], self._inbox[rid]
                    while box:
                        out = box.popleft()
                        if res.outputs[out.index].finish_reason is not None:
                            continue
                        before = res.finished
                        if out.index == 0:
                            res.num_cached_tokens = out.num_cached_tokens
                        self._apply(res.outputs[out.index], texts[rid, out.index], out)
                        if res.finished and not before:
                            pending -= 1
                            bar.update(1)
            bar.close()
        finally:
            for rid in results:
                self._release(rid)
        return list(results.values())

    def _apply(self, sample: CompletionOutput, text: _SampleText, out: EngineOutput) -> None:
        if out.error is not None:
            raise ValueError(out.error)
        delta, stopped, kept = text.push(out)  # ids past a stop string's token are not output
        sample.token_ids.extend(out.new_token_ids[:kept])
        if out.new_logprobs is not None:
            if sample.logprobs is None:
                sample.logprobs = []
            sample.logprobs.extend(out.new_logprobs[:kept])
        sample.text += delta
        if stopped is not None:
            self.engine.abort(out.request_id, out.index)
            sample.finish_reason, sample.matched_stop = "stop", stopped
        elif out.finished:
            sample.finish_reason, sample.matched_stop = out.finish_reason, out.matched_stop
