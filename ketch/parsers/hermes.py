"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
with content around them. Used by Qwen2.5/Qwen3, Hermes, and by our tool prompt for models whose
template has no tool support (see tool_prompt.py)."""
from __future__ import annotations

from ketch.parsers.tool_stream import Steps, StreamingToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(StreamingToolParser):
    def _parse(self) -> Steps:
        while True:
            if (yield from self._content_until((OPEN,))) is None:
                return None
            yield from self._skip_ws()
            yield from self._call_object()
            yield from self._skip_ws()
            yield from self._expect((CLOSE,))  # the call counts only once it is closed
            self._complete()
