"""The streaming machinery every tool-call format shares.

A format is written as a generator (`_parse`) that reads the output front to back with the helpers
below and `yield`s whenever it needs text that has not arrived yet; `feed` appends text and resumes
it, `finish` sets end-of-input and resumes it one last time. Decisions therefore depend only on the
characters, never on how they were split into chunks, and one machine serves both APIs.

Content handling: text that might start a call's trigger is held until decided; whitespace right
before a call and right after one is layout, not content, and is dropped (so "Sure.\\n<tool_call>"
gives content "Sure."); content with no call around it is passed through exactly.

Failure: whatever breaks a call (bad JSON, end of input before the call closed, an unknown name)
raises `_Malformed`; the call's raw text from its trigger on, and everything after it, becomes plain
content. Calls completed before stay. One exception, the end of the output (max_tokens, a stop
string) inside a call that was already announced: the stream has sent that call, so the result keeps
it too, with the argument text read so far (`truncated` when that is not a whole JSON object). A
call announced and then broken by bad text cannot be taken back: it is the only way the stream and
the final message can differ (see README).

With `max_calls`, reading stops once that many calls are complete: the rest of the output is dropped,
and `calls_complete` says so at once (at the character that closed the last call).
"""
from __future__ import annotations

import json
import re
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

from ketch.parsers.base import (
    ToolCall,
    ToolCallDelta,
    ToolDelta,
    ToolParser,
    ToolResult,
    held_length,
    merge_call_deltas,
    openai_call_id,
)
from ketch.parsers.json_scan import DONE, ERROR, KEY, NEED_MORE, VALUE_END, VALUE_START, JsonScanner, is_json_object

Steps = Generator[None, None, object]

_WS = " \t\r\n"
_WS_RE = re.compile(r"[ \t\r\n]*")
NAME_RE = re.compile(r"[\w.\-:]*")
ARG_KEYS = ("arguments", "parameters")
_NOTHING = ToolDelta()


class _Malformed(Exception):
    """The call being read cannot be completed; its text becomes content."""


class _LimitReached(Exception):
    """max_calls calls are complete: the answer ends here."""


@dataclass
class _OpenCall:
    index: int
    id: str
    name: str
    pieces: list[str] = field(default_factory=list)


class StreamingToolParser(ToolParser):
    def __init__(self, tool_names: frozenset[str] | None = None, max_calls: int | None = None) -> None:
        super().__init__(tool_names, max_calls)
        self._text = ""  # input not yet trimmed away; positions below index into it
        self._pos = 0
        self._eof = False
        self._seg: int | None = None  # where the unfinished call's raw text starts
        self._seg_ws = ""  # whitespace held before that call: content again if the call breaks
        self._ws_hold = ""  # trailing whitespace of content, released when more content follows
        self._after_call = False  # drop whitespace until content resumes
        self._cur: _OpenCall | None = None
        self._calls: list[ToolCall] = []
        self._content: list[str] = []
        self._out_content: list[str] = []
        self._out_calls: list[ToolCallDelta] = []
        self._truncated = False  # the output ended inside the last call's arguments
        self._gen = self._main()
        self._done = False

    # --- public API ------------------------------------------------------------------------------

    def feed(self, text: str) -> ToolDelta:
        if self._eof:
            raise RuntimeError("tool parser: feed() after finish()")
        if text:
            self._text += text
            self._resume()
        return self._take()

    def finish(self) -> ToolDelta:
        if not self._eof:
            self._eof = True
            self._resume()
            self._out_content.append(self._ws_hold)
            self._ws_hold = ""
        return self._take()

    def result(self) -> ToolResult:
        if not self._eof:
            raise RuntimeError("tool parser: result() before finish()")
        limit_reached = self.max_calls is not None and len(self._calls) >= self.max_calls
        return ToolResult("".join(self._content), tuple(self._calls), self._truncated, limit_reached)

    # --- driver ----------------------------------------------------------------------------------

    def _resume(self) -> None:
        if not self._done:
            try:
                next(self._gen)
            except StopIteration:
                self._done = True

    def _take(self) -> ToolDelta:
        if not self._out_content and not self._out_calls:
            return _NOTHING
        content = "".join(self._out_content)
        self._out_content.clear()
        calls = merge_call_deltas(self._out_calls)
        self._out_calls.clear()
        if content:
            self._content.append(content)
        return ToolDelta(content, calls)

    def _main(self) -> Steps:
        try:
            yield from self._parse()
            return None
        except _LimitReached:
            while not self._eof:  # the rest of the output is not part of the answer
                self._text, self._pos = "", 0
                yield
            return None
        except _Malformed:
            # At the end of input no new characters arrived: the call was cut, not malformed. Once
            # announced it is the stream's, so the message keeps it (the same whole or streamed).
            if self._eof and self._cur is not None:
                self._keep_cut_call()
                return None
        start = self._seg if self._seg is not None else self._pos
        self._raw_content(self._seg_ws + self._text[start:])
        self._seg, self._seg_ws, self._cur = None, "", None
        while True:  # from here on everything is content
            self._text, self._pos = "", 0
            if self._eof:
                return None
            yield
            self._raw_content(self._text)

    def _parse(self) -> Steps:
        """The format: read with the helpers below; return at end of input."""
        raise NotImplementedError

    def _new_id(self) -> str:
        return openai_call_id()

    # --- content ---------------------------------------------------------------------------------

    def _raw_content(self, s: str) -> None:
        if s:
            self._out_content.append(self._ws_hold + s)
            self._ws_hold = ""

    def _emit_content(self, s: str) -> None:
        if self._after_call:
            s = s.lstrip(_WS)
            if not s:
                return
            self._after_call = False
        core = s.rstrip(_WS)
        if not core:
            self._ws_hold += s
            return
        self._out_content.append(self._ws_hold + core)
        self._ws_hold = s[len(core) :]

    def _content_until(self, triggers: Sequence[str], first: Sequence[str] = ()) -> Steps:
        """Pass content through until a trigger; return the trigger (consumed) or None at the end.

        `first`: one-character triggers that count only as the first non-blank character here
        (Llama's bare `{` at the start of the output, its `;` between calls)."""
        self._text, self._pos = self._text[self._pos :], 0  # no call is open: forget consumed text
        if first:
            while True:
                end = _WS_RE.match(self._text, self._pos).end()
                self._emit_content(self._text[self._pos : end])
                self._pos = end
                if end < len(self._text):
                    break
                if self._eof:
                    return None
                yield
            if self._text[self._pos] in first:
                return self._open(self._text[self._pos])
        while True:
            text, pos = self._text[self._pos :], 0  # consumed content is gone for good
            self._text, self._pos = text, 0
            best, trigger = -1, None
            for t in triggers:
                i = text.find(t, pos)
                if i >= 0 and (best < 0 or i < best):
                    best, trigger = i, t
            if trigger is not None:
                self._emit_content(text[pos:best])
                self._pos = best
                return self._open(trigger)
            end = len(text) if self._eof else len(text) - held_length(text, pos, triggers)
            self._emit_content(text[pos:end])
            self._pos = end
            if self._eof:
                return None
            yield

    def _open(self, trigger: str) -> str:
        self._seg, self._seg_ws, self._ws_hold = self._pos, self._ws_hold, ""
        self._pos += len(trigger)
        return trigger

    # --- reading helpers (each raises _Malformed when the text cannot continue the call) ---------

    def _need(self, n: int) -> Steps:
        while len(self._text) - self._pos < n:
            if self._eof:
                raise _Malformed
            yield

    def _skip_ws(self) -> Steps:
        while True:
            self._pos = _WS_RE.match(self._text, self._pos).end()
            if self._pos < len(self._text) or self._eof:
                return None
            yield

    def _at_end(self) -> bool:
        return self._eof and self._pos >= len(self._text)

    def _expect(self, literals: Sequence[str]) -> Steps:
        """Consume whichever literal comes next; return it."""
        longest = max(len(lit) for lit in literals)
        while True:
            rest = self._text[self._pos : self._pos + longest]
            for lit in literals:
                if rest.startswith(lit):
                    self._pos += len(lit)
                    return lit
            if self._eof or not any(lit.startswith(rest) for lit in literals):
                raise _Malformed
            yield

    def _read(self, pattern: re.Pattern[str]) -> Steps:
        """Consume a run of `pattern` that is followed by something else; return it."""
        start = self._pos
        while True:
            self._pos = pattern.match(self._text, self._pos).end()
            if self._pos < len(self._text):
                return self._text[start : self._pos]
            if self._eof:
                raise _Malformed
            yield

    # --- calls -----------------------------------------------------------------------------------

    def _check_name(self, name: object) -> str:
        if not isinstance(name, str) or not name or (self.tool_names is not None and name not in self.tool_names):
            raise _Malformed
        return name

    def _announce(self, name: str) -> None:
        self._cur = _OpenCall(len(self._calls), self._new_id(), name)
        self._out_calls.append(ToolCallDelta(self._cur.index, self._cur.id, name, ""))

    def _send_args(self, piece: str) -> None:
        if piece and self._cur is not None:
            self._cur.pieces.append(piece)
            self._out_calls.append(ToolCallDelta(self._cur.index, arguments=piece))

    def _complete(self, reopen: bool = False) -> None:
        """The open call is final. reopen: the text after it still belongs to an unfinished group
        (a JSON list, a DeepSeek block) and is content if that group breaks."""
        self._record_call(reopen)
        if self.max_calls is not None and len(self._calls) >= self.max_calls:
            self.calls_complete = True
            raise _LimitReached

    def _record_call(self, reopen: bool = False) -> None:
        cur = self._cur
        assert cur is not None
        self._calls.append(ToolCall(cur.id, cur.name, "".join(cur.pieces)))
        self._cur = None
        self._close_segment(reopen)

    def _keep_cut_call(self) -> None:
        """The output ended inside the announced call: it ends with the arguments sent so far (for
        object arguments all that was read of them: the scanner consumes every valid character).
        The rest of its raw text is the format's markup, which the call stands for, not content."""
        assert self._cur is not None
        self._truncated = not is_json_object("".join(self._cur.pieces))
        self._record_call()  # the end of the output: nothing follows to drop

    def _close_segment(self, reopen: bool = False) -> None:
        self._seg, self._seg_ws = (self._pos if reopen else None), ""
        self._after_call = True

    def _args_object(self) -> Steps:
        """The announced call's arguments: a JSON object at the cursor, streamed as it is validated."""
        yield from self._need(1)
        start = self._pos
        if self._text[start] != "{":
            raise _Malformed
        scanner = JsonScanner()
        sent = start
        while True:
            ev, self._pos = scanner.scan(self._text, self._pos)
            if ev == ERROR:
                raise _Malformed
            self._send_args(self._text[sent : self._pos])
            sent = self._pos
            if ev == DONE:
                return None
            if ev == NEED_MORE:
                if self._eof:
                    raise _Malformed
                yield

    def _call_object(
        self, announce_on_name: bool = True, require_args: bool = False, keys: frozenset[str] | None = None
    ) -> Steps:
        """A `{"name": ..., "arguments": {...}}` object at the cursor (`parameters` works too).

        The call is announced when its name is read (or, with announce_on_name=False, once the
        arguments begin too: a bare JSON object might be content, not a call); argument text is
        sent as it is validated. String-encoded arguments (a JSON object inside a JSON string)
        are sent decoded, when complete. keys: the only keys allowed (others break the call)."""
        yield from self._need(1)
        if self._text[self._pos] != "{":
            raise _Malformed
        scanner = JsonScanner()
        name: str | None = None
        key: str | None = None
        seen: set[str] = set()
        value_start = args_start = args_end = -1
        decoded: str | None = None  # string-encoded arguments, decoded; "{}" when absent
        sent = 0
        while True:
            ev, self._pos = scanner.scan(self._text, self._pos)
            text = self._text
            if ev == ERROR:
                raise _Malformed
            if ev == KEY:
                key = json.loads(text[scanner.at : self._pos])
                if key in seen or (keys is not None and key not in keys):
                    raise _Malformed
                seen.add(key)
            elif ev == VALUE_START:
                value_start = scanner.at
                if key in ARG_KEYS:
                    if args_start >= 0 or text[value_start] not in '{"':
                        raise _Malformed
                    args_start = value_start
                elif key == "name" and text[value_start] != '"':
                    raise _Malformed
            elif ev == VALUE_END:
                if key == "name":
                    name = self._check_name(json.loads(text[value_start : scanner.at]))
                elif key in ARG_KEYS:
                    args_end = scanner.at
                    if text[args_start] == '"':
                        decoded = json.loads(text[args_start:args_end])
                        if not is_json_object(decoded):
                            raise _Malformed
            elif ev == DONE:
                if name is None or (args_start < 0 and require_args):
                    raise _Malformed
                if args_start < 0:
                    decoded = "{}"
            if self._cur is None and name is not None and (announce_on_name or args_start >= 0 or ev == DONE):
                self._announce(name)
            if self._cur is not None:
                if decoded is not None:
                    available = decoded
                elif args_start >= 0 and text[args_start] == "{":
                    available = text[args_start : args_end if args_end >= 0 else self._pos]
                else:
                    available = ""
                self._send_args(available[sent:])
                sent = len(available)
            if ev == DONE:
                return None
            if ev == NEED_MORE:
                if self._eof:
                    raise _Malformed
                yield
