"""Llama 3.1/3.2 JSON tool calls: `{"name": ..., "parameters": {...}}` as the whole output (or after
`<|python_tag|>`), several separated by `;`.

A bare `{` is a call only as the first non-blank character of the output; the object is held back
until its keys show it is a call (only name/parameters/arguments/type allowed, both name and
arguments present), so a JSON answer that is not a call comes out as content. `<|python_tag|>`
is a special token: it reaches the parser only when special tokens are not skipped in decoding.
"""
from __future__ import annotations

from ketch.parsers.tool_stream import Steps, StreamingToolParser

PYTHON_TAG = "<|python_tag|>"
_KEYS = frozenset(("name", "parameters", "arguments", "type"))


class Llama3ToolParser(StreamingToolParser):
    def _parse(self) -> Steps:
        first = ("{",)
        while True:
            trigger = yield from self._content_until((PYTHON_TAG,), first=first)
            if trigger is None:
                return None
            if trigger == "{":
                self._pos -= 1  # the brace is the object's first character
            else:
                yield from self._skip_ws()
            yield from self._call_object(announce_on_name=False, require_args=True, keys=_KEYS)
            self._complete()
            first = (";",)
