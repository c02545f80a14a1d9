"""Types and interfaces shared by the reasoning and tool-call parsers.

Every parser is one state machine that serves both APIs: streaming feeds text deltas as the
detokenizer produces them; non-streaming feeds the whole text once. Either way `finish()` ends the
stream and `result()` is the same, whatever the split (the machine decides on characters, never
on where a chunk happened to end).
"""
from __future__ import annotations

import abc
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """A finished call: `arguments` is a JSON object as text, exactly the streamed pieces joined."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`: the first piece of a call carries its id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def merge_call_deltas(deltas: list[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """One delta per call per feed: its first piece keeps id and name, argument pieces are joined."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index:
            last = out[-1]
            out[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + d.arguments)
        else:
            out.append(d)
    return tuple(out)


@dataclass(frozen=True)
class ToolDelta:
    """What one feed (or finish) of a tool parser produced."""

    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass(frozen=True)
class ToolResult:
    content: str
    calls: tuple[ToolCall, ...] = field(default_factory=tuple)
    # The output ended inside the last call's arguments: they are an unfinished JSON prefix
    # (possibly empty), exactly as streamed.
    truncated: bool = False
    # The parser's max_calls was reached: the answer ended with the last call, whatever followed.
    limit_reached: bool = False


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


@dataclass(frozen=True)
class ReasoningResult:
    reasoning: str | None  # None: the output had no reasoning part (an empty one also counts as none)
    content: str


def held_length(text: str, start: int, literals: Sequence[str]) -> int:
    """Length of the longest suffix of text[start:] that some literal starts with: text that may
    still become that literal and must be held back until the next characters decide."""
    window = max(start, len(text) - max(len(lit) for lit in literals) + 1)
    best = len(text)
    for first in {lit[0] for lit in literals}:  # str.find does the scanning: this runs per token
        j = text.find(first, window, best)
        while j >= 0:
            tail = text[j:]
            if any(lit.startswith(tail) for lit in literals):
                best = j
                break
            j = text.find(first, j + 1, best)
    return len(text) - best


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ReasoningParser(abc.ABC):
    """Splits model output into reasoning and content. Reasoning always comes first."""

    @abc.abstractmethod
    def feed(self, text: str) -> ReasoningDelta: ...

    @abc.abstractmethod
    def finish(self) -> ReasoningDelta:
        """End of output: release whatever was held back. Later feeds are errors."""

    @abc.abstractmethod
    def result(self) -> ReasoningResult:
        """The whole split; valid after finish()."""


class ToolParser(abc.ABC):
    """Pulls tool calls out of the content part of model output. Never raises on model output:
    text that does not complete a well-formed call (bad JSON, an unknown function name when tools
    were given, a call cut by the end of the output before its name was read) is released as plain
    content. A call cut by the end after it was announced stays a call (see ToolResult.truncated)."""

    def __init__(self, tool_names: frozenset[str] | None = None, max_calls: int | None = None) -> None:
        # None: any name is accepted (no tool list to check against).
        self.tool_names = tool_names
        # At most this many calls (None: any number); the output after the last one is dropped,
        # calls and content alike (`parallel_tool_calls: false`).
        self.max_calls = max_calls
        # max_calls calls are complete: set as the last one closes (before finish()), so the output
        # can end right there (the server stops the sample at that token).
        self.calls_complete = False

    @abc.abstractmethod
    def feed(self, text: str) -> ToolDelta: ...

    @abc.abstractmethod
    def finish(self) -> ToolDelta: ...

    @abc.abstractmethod
    def result(self) -> ToolResult: ...
