"""DeepSeek-V3 tool calls (format of its tokenizer_config chat template):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

DeepSeek-V3.1's shorter form, `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`, is read
too. The markers are special tokens: they reach the parser only when special tokens are not skipped
in decoding. A missing `<｜tool▁calls▁end｜>` at the very end of the output is forgiven (every call
before it was complete); a call without its `<｜tool▁call▁end｜>` is not.
"""
from __future__ import annotations

from ketch.parsers.tool_stream import NAME_RE, Steps, StreamingToolParser, _Malformed

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"


class DeepSeekV3ToolParser(StreamingToolParser):
    def _parse(self) -> Steps:
        while True:
            if (yield from self._content_until((CALLS_BEGIN,))) is None:
                return None
            first = True
            while True:
                yield from self._skip_ws()
                if not first and self._at_end():
                    self._close_segment()
                    return None
                if (yield from self._expect((CALL_BEGIN,) if first else (CALL_BEGIN, CALLS_END))) == CALLS_END:
                    self._close_segment()
                    break
                first = False
                yield from self._call()
                self._complete(reopen=True)

    def _call(self) -> Steps:
        head = yield from self._read(NAME_RE)
        yield from self._expect((SEP,))
        yield from self._need(1)
        fenced = self._text[self._pos] != "{"
        if fenced:  # V3: the type before the separator, the name after it, arguments in a fence
            if head != "function":
                raise _Malformed
            head = yield from self._read(NAME_RE)
            yield from self._skip_ws()
            yield from self._expect((FENCE,))
            yield from self._need(1)
            if self._text[self._pos] == "j":
                yield from self._expect(("json",))
            yield from self._skip_ws()
        self._announce(self._check_name(head))
        yield from self._args_object()
        yield from self._skip_ws()
        if fenced:
            yield from self._expect((FENCE,))
            yield from self._skip_ws()
        yield from self._expect((CALL_END,))
