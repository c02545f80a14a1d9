"""Reasoning parsers: split `<think>…</think>` reasoning from the answer.

- `deepseek-r1`: the output is reasoning until `</think>`, whether or not it starts with `<think>`
  (R1's template opens the block itself, so the model's output often starts inside it).
- `qwen3`: reasoning only when the output starts with `<think>`; with thinking disabled the
  template closes an empty block in the prompt and the output is all content.

Whitespace at the edges of the reasoning and right after `</think>` is layout and is dropped; an
empty reasoning block counts as none. Output that ends before `</think>` (cut by max_tokens) stays
reasoning: that is what it was, and it was streamed as such. With enable_thinking=False (the
request turned thinking off) everything is content.
"""
from __future__ import annotations

from ketch.parsers.base import ReasoningDelta, ReasoningParser, ReasoningResult, held_length

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_WS = " \t\r\n"
_CLOSE = (THINK_CLOSE,)

_START, _REASONING, _CONTENT_LEAD, _CONTENT = range(4)


class ThinkReasoningParser(ReasoningParser):
    # True: output that does not open with <think> is still reasoning (the template opened it).
    implicit_open = False

    def __init__(self, enable_thinking: bool = True) -> None:
        self._state = _START if enable_thinking else _CONTENT
        self._buf = ""  # undecided text (a possible tag)
        self._ws = ""  # trailing whitespace of the reasoning, released if more reasoning follows
        self._started = False  # any reasoning text emitted yet (leading whitespace is dropped)
        self._in_reasoning = False
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._finished = False

    def feed(self, text: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("reasoning parser: feed() after finish()")
        return self._step(text, final=False)

    def finish(self) -> ReasoningDelta:
        if self._finished:
            return ReasoningDelta()
        self._finished = True
        return self._step("", final=True)

    def result(self) -> ReasoningResult:
        if not self._finished:
            raise RuntimeError("reasoning parser: result() before finish()")
        reasoning = "".join(self._reasoning)
        return ReasoningResult(reasoning or None, "".join(self._content))

    def _step(self, text: str, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        buf = self._buf + text
        self._buf = ""
        if self._state == _START:
            body = buf.lstrip(_WS)
            if body.startswith(THINK_OPEN):
                self._state, buf = _REASONING, body[len(THINK_OPEN) :]
            elif not final and (not body or THINK_OPEN.startswith(body)):
                self._buf = buf  # still undecided
                return ReasoningDelta()
            else:
                self._state = _REASONING if self.implicit_open else _CONTENT
        if self._state == _REASONING:
            end = buf.find(THINK_CLOSE)
            if end >= 0:
                self._reason(buf[:end], reasoning)  # its trailing whitespace stays held: dropped
                self._state, buf = _CONTENT_LEAD, buf[end + len(THINK_CLOSE) :]
            else:
                keep = 0 if final else held_length(buf, 0, _CLOSE)
                self._reason(buf[: len(buf) - keep], reasoning)
                self._buf = buf[len(buf) - keep :]
                buf = ""
        if self._state == _CONTENT_LEAD:
            buf = buf.lstrip(_WS)
            if buf:
                self._state = _CONTENT
        if self._state == _CONTENT and buf:
            content.append(buf)
        delta = ReasoningDelta("".join(reasoning), "".join(content))
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
        if delta.content:
            self._content.append(delta.content)
        return delta

    def _reason(self, s: str, out: list[str]) -> None:
        if not self._started:
            s = s.lstrip(_WS)
            if not s:
                return
            self._started = True
        core = s.rstrip(_WS)
        if not core:
            self._ws += s
            return
        out.append(self._ws + core)
        self._ws = s[len(core) :]


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    implicit_open = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    implicit_open = False
