"""Mistral tool calls, both generations:

- `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizer v3 / Mistral-7B-v0.3, Nemo),
- `[TOOL_CALLS]name[ARGS]{...}` repeated per call (v13, Mistral Small 3.2, Devstral), also with
  `[CALL_ID]id` before `[ARGS]` (v11) or the arguments straight after the name.

`[TOOL_CALLS]` and `[ARGS]` are control tokens: they reach the parser only when special tokens are
not skipped in decoding. Call ids are 9 alphanumerics, the only form Mistral templates accept back.
"""
from __future__ import annotations

import re
import secrets
import string

from ketch.parsers.tool_stream import NAME_RE, Steps, StreamingToolParser

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_CHARS = string.ascii_letters + string.digits
_CALL_ID_RE = re.compile(r"[A-Za-z0-9_\-]*")


class MistralToolParser(StreamingToolParser):
    def _new_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def _parse(self) -> Steps:
        while True:
            if (yield from self._content_until((TOOL_CALLS,))) is None:
                return None
            yield from self._need(1)
            if self._text[self._pos] in " \t\r\n[":
                yield from self._skip_ws()
                yield from self._json_list()
            else:
                yield from self._named_call()

    def _json_list(self) -> Steps:
        yield from self._expect(("[",))
        yield from self._skip_ws()
        yield from self._need(1)
        if self._text[self._pos] == "]":
            self._pos += 1
            self._close_segment()
            return None
        while True:
            yield from self._call_object()
            self._complete(reopen=True)  # a broken later element does not take this one with it
            yield from self._skip_ws()
            if self._at_end():  # the list was cut after a whole element: keep what is whole
                self._close_segment()
                return None
            if (yield from self._expect((",", "]"))) == "]":
                self._close_segment()
                return None
            yield from self._skip_ws()

    def _named_call(self) -> Steps:
        name = self._check_name((yield from self._read(NAME_RE)))
        if self._text[self._pos] == "[":
            if (yield from self._expect((ARGS, CALL_ID))) == CALL_ID:
                yield from self._read(_CALL_ID_RE)
                yield from self._expect((ARGS,))
        self._announce(name)
        yield from self._args_object()
        self._complete()
