"""CLI names (`--tool-call-parser`, `--reasoning-parser`) to parser classes."""
from __future__ import annotations

from ketch.parsers.base import ReasoningParser, ToolParser
from ketch.parsers.deepseek_v3 import DeepSeekV3ToolParser
from ketch.parsers.hermes import HermesToolParser
from ketch.parsers.llama3 import Llama3ToolParser
from ketch.parsers.mistral import MistralToolParser
from ketch.parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3": Llama3ToolParser,
    "mistral": MistralToolParser,
    "deepseek-v3": DeepSeekV3ToolParser,
}

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek-r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def tool_parser_class(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser: unknown {name!r}; choose from {', '.join(TOOL_PARSERS)}") from None


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"reasoning_parser: unknown {name!r}; choose from {', '.join(REASONING_PARSERS)}") from None
