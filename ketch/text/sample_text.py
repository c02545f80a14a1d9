"""The text of one generated sample: incremental detokenization plus stop strings.

Shared by the offline `LLM` and the server's API process, which both receive token deltas
(EngineOutput in-process, TokenDelta over ZMQ) with the same field names.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from ketch.text.detokenizer import IncrementalDetokenizer
from ketch.text.stop import StopChecker
from ketch.text.tokenizer import Tokenizer


class TokenDeltaLike(Protocol):
    new_token_ids: list[int]
    finished: bool
    matched_stop: int | str | None


class SampleTextParams(Protocol):
    stop: Sequence[str]
    min_tokens: int
    skip_special_tokens: bool


class SampleText:
    """Detokenizer + stop-string watcher for one sample.

    Stop strings count only once `min_tokens` tokens exist (like stop token ids); the text of
    a stop token (EOS or stop_token_ids) is not part of the output.
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], params: SampleTextParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens) if tokenizer else None
        self.stop = StopChecker(params.stop) if (tokenizer and params.stop) else None
        self.min_tokens = params.min_tokens
        self.num_tokens = 0

    def push(self, out: TokenDeltaLike) -> tuple[str, str | None]:
        """Text delta for this output, and the stop string it completed (if any)."""
        if self.detok is None:
            return "", None
        ids = out.new_token_ids
        self.num_tokens += len(ids)
        if out.finished and isinstance(out.matched_stop, int) and ids:
            ids = ids[:-1]  # the stop token itself
        text = self.detok.push(ids)
        if out.finished:
            text += self.detok.flush()
        if self.stop is None:
            return text, None
        if self.num_tokens < self.min_tokens:
            return self.stop.flush() + text, None
        emitted, matched = self.stop.feed(text)
        if matched is None and out.finished:
            emitted += self.stop.flush()
        return emitted, matched
