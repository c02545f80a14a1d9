"""The grammar gate (scheduler/gate.py): a request whose grammar is still compiling waits here
(state PENDING, set by the scheduler), outside the scheduler's queues.

    scheduler.park(samples, gate, spec) ──compile done──▶ release() ──▶ scheduler.add
                                         └─compile failed─▶ release() reports the error

Only the request whose grammar compiles waits; others keep running. Specs are checked for
syntax in `check` (synchronously, cheap) so a bad grammar is a ValueError at add time.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from ketch.sampling.grammar.spec import GrammarSpec
from ketch.scheduler.request import Request


@dataclass
class Parked:
    samples: list[Request]
    compiled: Future[Any]


class GrammarGate:
    def __init__(self, tokenizer_path: str | None, vocab_size: int, stop_token_ids: tuple[int, ...],
                 device: Any = "cpu") -> None:
        self._tokenizer_path = tokenizer_path
        self._device = device
        self._vocab_size = vocab_size
        self._stop_ids = stop_token_ids
        self._cache = None  # built on the first grammar request: xgrammar and the tokenizer load then
        self.parked: list[Parked] = []

    def check(self, spec: GrammarSpec) -> None:
        if self._tokenizer_path is None:
            raise ValueError(f"{spec.kind}: constrained decoding needs the model's tokenizer, and this model has none")
        from ketch.sampling.grammar.xgrammar_backend import XGrammarBackend

        XGrammarBackend.check(spec)

    def park(self, samples: list[Request], spec: GrammarSpec) -> None:
        # A copy: `forget` removes aborted samples from it, and the caller's list (the engine's
        # record of the request, which it iterates while aborting) must not shrink under it.
        self.parked.append(Parked(list(samples), self._compiler().submit(spec)))

    def release(self) -> list[tuple[list[Request], Exception | None]]:
        """Parked groups whose compile has ended: matchers attached, or the compile's error."""
        done = [p for p in self.parked if p.compiled.done()]
        if not done:
            return []
        self.parked = [p for p in self.parked if not p.compiled.done()]
        out = []
        for p in done:
            error = p.compiled.exception()
            if error is None:
                backend = self._compiler().backend
                for req in p.samples:
                    req.grammar = backend.new_matcher(p.compiled.result())
                    error = error or _replay(req)
            out.append((p.samples, error))
        return out

    def has_parked(self) -> bool:
        return bool(self.parked)

    def wait(self, timeout: float) -> None:
        """Block until some parked compile ends (or `timeout`): an engine with nothing else to run
        sleeps here instead of spinning, which would also starve the compile thread of the GIL."""
        if self.parked:
            wait([p.compiled for p in self.parked], timeout=timeout, return_when=FIRST_COMPLETED)

    def forget(self, req: Request) -> None:
        """An aborted PENDING sample leaves its group (the group goes when it is empty)."""
        for p in self.parked:
            if req in p.samples:
                p.samples.remove(req)
        self.parked = [p for p in self.parked if p.samples]

    def _compiler(self):
        if self._cache is None:
            from ketch.sampling.grammar.cache import GrammarCache
            from ketch.sampling.grammar.xgrammar_backend import XGrammarBackend
            from ketch.text.tokenizer import Tokenizer

            path, vocab, stop, device = self._tokenizer_path, self._vocab_size, self._stop_ids, self._device
            self._cache = GrammarCache(lambda: XGrammarBackend(Tokenizer.load(path).hf, vocab, stop, device))
        return self._cache

    def shutdown(self) -> None:
        if self._cache is not None:
            self._cache.shutdown()


def _replay(req: Request) -> ValueError | None:
    """A resumed sample's matcher takes the outputs it already has, as if it had made them."""
    for i, token in enumerate(req.output_ids[: req.num_resumed]):
        if not req.grammar.accept(token):
            return ValueError(f"generated_token_ids: token {i} ({token}) is not allowed by the grammar there")
    return None
