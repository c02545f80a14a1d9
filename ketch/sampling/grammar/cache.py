"""Compile grammars off the step loop, once per spec.

`submit(spec)` returns a Future at once; the first call for a spec starts its compile on a
worker thread, later ones share the same Future (an LRU of recent specs keeps them). The
engine polls `done()` between steps, so a request waits for its own grammar only. The backend
itself is built on the worker too (a tokenizer load can take seconds).
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from ketch.sampling.grammar.base import GrammarBackend
from ketch.sampling.grammar.spec import GrammarSpec

MAX_CACHED = 256


class GrammarCache:
    def __init__(self, make_backend: Callable[[], GrammarBackend], workers: int = 1) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ketch-grammar")
        self._backend: Future[GrammarBackend] = self._pool.submit(make_backend)
        self._compiled: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()

    @property
    def backend(self) -> GrammarBackend:
        """Blocks until the backend is built (callers only ask once a compile is done)."""
        return self._backend.result()

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        fut = self._compiled.get(spec)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._pool.submit(lambda: self.backend.compile(spec))
            self._compiled[spec] = fut
        self._compiled.move_to_end(spec)
        while len(self._compiled) > MAX_CACHED:
            self._compiled.popitem(last=False)
        return fut

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
