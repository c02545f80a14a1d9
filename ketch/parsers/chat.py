"""ChatOutputParser: reasoning split first, then tool calls out of the content, as OpenAI shapes.

Streaming: `feed(text)` per detokenized delta returns a `choices[i].delta` dict (or None when the
text was held back or was only layout), `finish()` the last one. Non-streaming: `parse(text)`.
Either way `message()` is the final assistant message, the same whatever the chunking, and
`finish_reason(engine_reason)` the choice's finish reason.

Delta dict keys, each present only when non-empty:
    reasoning_content: str
    content: str
    tool_calls: [{"index", "id", "type": "function", "function": {"name", "arguments"}}  first piece
                 {"index", "function": {"arguments"}}]                                      later pieces
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ketch.parsers.base import ReasoningParser, ToolCall, ToolDelta, ToolParser
from ketch.parsers.registry import reasoning_parser_class, tool_parser_class


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> frozenset[str] | None:
    """Function names of an OpenAI `tools` list; None when there is no list to check against."""
    if not tools:
        return None
    names = set()
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


class ChatOutputParser:
    def __init__(
        self,
        reasoning_parser: str | None = None,
        tool_parser: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        enable_thinking: bool = True,
        max_calls: int | None = None,
    ) -> None:
        """reasoning_parser / tool_parser: registry names or None (no such parsing). tools: the
        request's tool list (calls to other names stay content). enable_thinking=False: the request
        turned thinking off, so there is no reasoning part. max_calls: the answer ends with that
        many calls, the rest of the output is dropped (1 for `parallel_tool_calls: false`)."""
        self._reasoning: ReasoningParser | None = (
            reasoning_parser_class(reasoning_parser)(enable_thinking=enable_thinking) if reasoning_parser else None
        )
        self._tools: ToolParser | None = (
            tool_parser_class(tool_parser)(tool_names(tools), max_calls) if tool_parser else None
        )
        self._content: list[str] = []
        self._reasoning_text: list[str] = []
        self._finished = False

    @classmethod
    def parse(cls, text: str, **kwargs: Any) -> dict[str, Any]:
        """Non-streaming: the final message for a whole output."""
        parser = cls(**kwargs)
        parser.feed(text)
        parser.finish()
        return parser.message()

    def feed(self, text: str) -> dict[str, Any] | None:
        if self._finished:
            raise RuntimeError("ChatOutputParser: feed() after finish()")
        if not text:
            return None
        if self._reasoning is None:
            return self._delta("", self._tools.feed(text) if self._tools else ToolDelta(text))
        r = self._reasoning.feed(text)
        return self._delta(r.reasoning, self._content_delta(r.content, final=False))

    def finish(self) -> dict[str, Any] | None:
        if self._finished:
            return None
        self._finished = True
        reasoning = ""
        content = ToolDelta()
        if self._reasoning is not None:
            r = self._reasoning.finish()
            reasoning = r.reasoning
            content = self._content_delta(r.content, final=True)
        elif self._tools is not None:
            content = self._tools.finish()
        return self._delta(reasoning, content)

    def _content_delta(self, text: str, final: bool) -> ToolDelta:
        if self._tools is None:
            return ToolDelta(text)
        first = self._tools.feed(text) if text else ToolDelta()
        if not final:
            return first
        last = self._tools.finish()
        return ToolDelta(first.content + last.content, first.calls + last.calls)

    def _delta(self, reasoning: str, tools: ToolDelta) -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
            self._reasoning_text.append(reasoning)
        if tools.content:
            out["content"] = tools.content
            self._content.append(tools.content)
        if tools.calls:
            calls = []
            for d in tools.calls:
                if d.id is not None:
                    fn = {"name": d.name, "arguments": d.arguments}
                    calls.append({"index": d.index, "id": d.id, "type": "function", "function": fn})
                else:
                    calls.append({"index": d.index, "function": {"arguments": d.arguments}})
            out["tool_calls"] = calls
        return out or None

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The calls, as streamed (after finish()); the last one may be cut (see `truncated`)."""
        return self._tools.result().calls if self._tools is not None and self._finished else ()

    @property
    def truncated(self) -> bool:
        """The output ended inside the last call's arguments (after finish())."""
        return self._tools is not None and self._finished and self._tools.result().truncated

    @property
    def calls_complete(self) -> bool:
        """max_calls calls are complete, known as the text closing the last one is fed (before
        finish()): nothing after it is part of the answer, so the output can end there."""
        return self._tools is not None and self._tools.calls_complete

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The choice's finish reason from the engine's ("stop", "length", ...): "tool_calls" when it
        stopped on its own after whole calls, or when max_calls whole calls ended the answer (what the
        model wrote after them, cut by max_tokens or not, is not part of it). A cut keeps the
        engine's reason ("length" for max_tokens, as OpenAI reports it), so a client knows the last
        arguments are unfinished."""
        if not self.tool_calls or self.truncated:
            return engine_reason
        limit_reached = self._tools is not None and self._tools.result().limit_reached
        if engine_reason == "stop" or (engine_reason == "length" and limit_reached):
            return "tool_calls"
        return engine_reason

    def message(self) -> dict[str, Any]:
        """{"role": "assistant", "content", "reasoning_content", "tool_calls"?}; after finish().

        content is None when it is empty and the message has tool calls or reasoning;
        reasoning_content is None without reasoning; tool_calls is present only when non-empty."""
        if not self._finished:
            raise RuntimeError("ChatOutputParser: message() before finish()")
        content = "".join(self._content)
        reasoning = "".join(self._reasoning_text) or None
        calls = self.tool_calls
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": None if not content and (calls or reasoning) else content,
            "reasoning_content": reasoning,
        }
        if calls:
            msg["tool_calls"] = [c.to_dict() for c in calls]
        return msg
