"""The text of one generated sample: incremental detokenization plus stop strings.

Shared by the offline `LLM` and the server's API process, which both receive token deltas
(EngineOutput in-process, TokenDelta over ZMQ) with the same field names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence

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


class Pushed(NamedTuple):
    text: str  # the text delta to emit
    stopped: str | None  # the stop string completed, if any: the sample ends here
    kept: int  # how many of the pushed ids belong to the output: all, or up to the one that completed `stopped`


@dataclass
class ReplayedTokens:
    """Ids pushed as a run of their own (a resumed stream's, a regenerated one's): not a finish."""
    new_token_ids: list[int]
    finished: bool = False
    matched_stop: int | str | None = None


class SampleText:
    """Detokenizer + stop-string watcher for one sample.

    Stop strings are checked token by token, whatever the deltas' sizes (a verify's several
    tokens, a server's joined deltas): the sample ends at the token whose text completes one, the
    ids after it in the same delta are not part of the output (`Pushed.kept`), and the result is
    that of one token per delta. A stop string counts only if the `min_tokens`-th token or a later
    one completes it (like stop token ids; it may begin in the text before). The text of a stop
    token (EOS or stop_token_ids) is not part of the output.

    `end` (optional): an end the text decides, the server's watch for the last tool call that
    `parallel_tool_calls: false` allows. It is fed each token's output text (what passed the stop
    strings, as a parser of the output reads it) and returns True once the output is complete; the
    sample then ends at that token as at a stop string (`ended`), from the `min_tokens`-th on.

    A resumed stream (`generated_ids`: the outputs another worker already streamed, engine
    README) starts where the original stood after them: they go through first, so the
    detokenizer's pending bytes and the stop checker's held text are the original's, a stop string
    spanning the boundary is still caught, and the continuation's text joins exactly.
    `resumed_text` is what the original emitted for them (its client has it).
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], params: SampleTextParams,
                 generated_ids: Sequence[int] = (), end: Callable[[str], bool] | None = None) -> None:
        if tokenizer is None and params.stop:  # there is no text to find them in: not ignored silently
            raise ValueError("stop: this model has no tokenizer, so stop strings cannot be matched; "
                             "send stop_token_ids")
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens) if tokenizer else None
        self.stop = StopChecker(params.stop) if (tokenizer and params.stop) else None
        self.min_tokens = params.min_tokens
        self.num_tokens = 0
        self.end = end if tokenizer else None
        self._end_seen = False  # `end` returned True (before min_tokens the sample goes on)
        self.ended = False  # `end` ended the sample (Pushed.kept: up to the token it did at)
        self.resumed_text = self._replay(list(generated_ids))

    def _replay(self, ids: list[int]) -> str:
        if not ids:
            return ""
        pushed = self.push(ReplayedTokens(ids))
        if pushed.stopped is not None:
            raise ValueError(f"generated_token_ids: their text contains the stop string {pushed.stopped!r}, "
                             f"so the stream ended there")
        if self.ended:
            raise ValueError("generated_token_ids: their text completes the last tool call allowed "
                             "(parallel_tool_calls: false), so the stream ended there")
        return pushed.text

    def push(self, out: TokenDeltaLike) -> Pushed:
        """Text delta for this output, the stop string it completed (if any), the ids it keeps."""
        ids = out.new_token_ids
        if self.detok is None:
            return Pushed("", None, len(ids))
        stop_token = out.finished and isinstance(out.matched_stop, int) and len(ids) > 0
        text_ids = ids[:-1] if stop_token else ids
        if self.stop is None and self.end is None:
            self.num_tokens += len(ids)
            text = self.detok.push(text_ids)
            return Pushed(text + self.detok.flush() if out.finished else text, None, len(ids))
        emitted: list[str] = []
        for i, token in enumerate(text_ids):
            self.num_tokens += 1
            matched = self._check(self.detok.push([token]), emitted)
            if matched is not None or self.ended:
                return Pushed("".join(emitted), matched, i + 1)
        self.num_tokens += len(ids) - len(text_ids)  # the stop token
        if out.finished:
            matched = self._check(self.detok.flush(), emitted)  # bytes the detokenizer still held
            if matched is not None:
                return Pushed("".join(emitted), matched, len(ids))
            if self.stop is not None:
                emitted.append(self.stop.flush())
        return Pushed("".join(emitted), None, len(ids))

    def _check(self, text: str, emitted: list[str]) -> str | None:
        """One token's text through the stop checker (before min_tokens as context only: a stop
        string may begin there but must end at the min_tokens-th token or later): what may go out
        is appended to `emitted`; the stop string it completed, if any. What goes out is fed to
        `end` (every token's, so that it reads the whole output; it ends the sample from the
        min_tokens-th token on)."""
        safe, matched = self.stop.feed(text, match=self.num_tokens >= self.min_tokens) if self.stop else (text, None)
        emitted.append(safe)
        if matched is None and self.end is not None:
            self._end_seen = self._end_seen or (bool(safe) and self.end(safe))
            self.ended = self._end_seen and self.num_tokens >= self.min_tokens
        return matched
