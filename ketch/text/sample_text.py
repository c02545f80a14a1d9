"""The text of one generated sample: incremental detokenization plus stop strings.

Shared by the offline `LLM` and the server's API process, which both receive token deltas
(EngineOutput in-process, TokenDelta over ZMQ) with the same field names.
"""
from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class ReplayedTokens:
    """Ids pushed as a run of their own (a resumed stream's, a regenerated one's): not a finish."""
    new_token_ids: list[int]
    finished: bool = False
    matched_stop: int | str | None = None


class SampleText:
    """Detokenizer + stop-string watcher for one sample.

    Stop strings count only once `min_tokens` tokens exist (like stop token ids); the text of
    a stop token (EOS or stop_token_ids) is not part of the output.

    A resumed stream (`generated_ids`: the outputs another worker already streamed, engine
    README) starts where the original stood after them: they go through first, in the pushes the
    original made as far as the text is concerned (those before min_tokens, then the rest), so the
    detokenizer's pending bytes and the stop checker's held text are the original's, a stop string
    spanning the boundary is still caught, and the continuation's text joins exactly.
    `resumed_text` is what the original emitted for them (its client has it).
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], params: SampleTextParams,
                 generated_ids: Sequence[int] = ()) -> None:
        if tokenizer is None and params.stop:  # there is no text to find them in: not ignored silently
            raise ValueError("stop: this model has no tokenizer, so stop strings cannot be matched; "
                             "send stop_token_ids")
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens) if tokenizer else None
        self.stop = StopChecker(params.stop) if (tokenizer and params.stop) else None
        self.min_tokens = params.min_tokens
        self.num_tokens = 0
        self.resumed_text = self._replay(list(generated_ids))

    def _replay(self, ids: list[int]) -> str:
        split = min(len(ids), max(0, self.min_tokens - 1))  # the pushes before min_tokens skip the stop check
        text = ""
        for part in (ids[:split], ids[split:]):
            if part:
                delta, stopped = self.push(ReplayedTokens(part))
                if stopped is not None:
                    raise ValueError(f"generated_token_ids: their text contains the stop string {stopped!r}, "
                                     f"so the stream ended there")
                text += delta
        return text

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
