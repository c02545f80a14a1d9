"""Reasoning and tool-call parsers for chat output: streaming state machines, OpenAI shapes."""
from ketch.parsers.base import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningResult,
    ToolCall,
    ToolCallDelta,
    ToolDelta,
    ToolParser,
    ToolResult,
)
from ketch.parsers.chat import ChatOutputParser, tool_names
from ketch.parsers.registry import REASONING_PARSERS, TOOL_PARSERS, reasoning_parser_class, tool_parser_class
from ketch.parsers.tool_prompt import apply_tool_prompt, render_tool_prompt, template_supports_tools, validate_tools

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChatOutputParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningResult",
    "ToolCall",
    "ToolCallDelta",
    "ToolDelta",
    "ToolParser",
    "ToolResult",
    "apply_tool_prompt",
    "reasoning_parser_class",
    "render_tool_prompt",
    "template_supports_tools",
    "tool_names",
    "tool_parser_class",
    "validate_tools",
]
