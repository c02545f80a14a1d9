"""How a chat request's tools and reasoning shape its prompt, its grammar and its output parsing.

    tools + tool_choice ─┬─ template knows tools ─▶ template gets `tools`; calls read by --tool-call-parser
                         └─ it does not (SmolLM2) ─▶ tools in the system prompt (hermes format); hermes reads
    tool_choice required / named ─▶ a grammar of calls in the parser's format (always parses)
    --reasoning-parser ─▶ <think>…</think> split off; a grammar then applies after the reasoning
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from ketch.parsers import ChatOutputParser, apply_tool_prompt, template_supports_tools, validate_tools
from ketch.parsers.tool_grammar import after_reasoning, answer_format, forced_calls, structural_tag
from ketch.sampling.grammar.spec import GrammarSpec
from ketch.sampling.params import SamplingParams
from ketch.server.errors import APIError, bad_value
from ketch.server.structured import check_grammar

# These formats' markers are special tokens: the text must keep them for the parser to see them.
_SPECIAL_TOKEN_PARSERS = ("mistral", "deepseek-v3", "llama3")
# deepseek-r1 templates open <think> themselves; qwen3 outputs it.
_OPENS_THINK = {"qwen3": True, "deepseek-r1": False}


@dataclass
class ChatPlan:
    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]  # tools and chat_template_kwargs for the template
    tools: list[dict[str, Any]] | None  # the request's tools the model may call (None: no tool parsing)
    tool_parser: str | None
    reasoning_parser: str | None
    enable_thinking: bool
    forced_grammar: dict[str, Any] | None  # calls only (tool_choice required / named)
    max_calls: int | None = None  # 1 for `parallel_tool_calls: false`, whatever the tool_choice

    def output_parser(self) -> ChatOutputParser:
        """One per choice; with neither parser it passes the text through as content, unchanged."""
        return ChatOutputParser(reasoning_parser=self.reasoning_parser, tool_parser=self.tool_parser,
                                tools=self.tools, enable_thinking=self.enable_thinking, max_calls=self.max_calls)

    def answer_end(self) -> Callable[[str], bool] | None:
        """With max_calls, one sample's watch of its output text: True once the last call allowed is
        complete. Nothing after it is part of the answer, so the sample ends at that token (its own
        parser, fed the same text as the choice's; None: no such end)."""
        if self.max_calls is None or self.tool_parser is None:
            return None
        parser = self.output_parser()

        def ended(text: str) -> bool:
            parser.feed(text)
            return parser.calls_complete
        return ended

    def grammar(self, answer: GrammarSpec | None, field: str | None) -> GrammarSpec | None:
        """The grammar to decode with: forced calls, or the response format; after the reasoning."""
        if self.forced_grammar is not None:
            fmt = self.forced_grammar
        elif answer is not None:
            if self.reasoning_parser is None or not self.enable_thinking:
                return answer
            fmt = answer_format(answer.kind, answer.source)
        else:
            return None
        if self.reasoning_parser is not None and self.enable_thinking:
            fmt = after_reasoning(fmt, _OPENS_THINK[self.reasoning_parser])
        spec = GrammarSpec("structural_tag", structural_tag(fmt))
        check_grammar(spec, field or "tools")
        return spec

    def adjust(self, params: SamplingParams, fields: dict[str, Any]) -> SamplingParams:
        if self.tool_parser in _SPECIAL_TOKEN_PARSERS and "skip_special_tokens" not in fields:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params


def _named_choice(choice: dict[str, Any], functions: list[dict[str, Any]]) -> dict[str, Any]:
    fn = choice.get("function") if choice.get("type", "function") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice: expected 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    for f in functions:
        if f["name"] == name:
            return f
    raise APIError(400, f"tool_choice: no tool named {name!r} in tools", param="tool_choice")


def _has_tool_turns(messages: Any) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or (m.get("role") == "assistant" and m.get("tool_calls")))
        for m in messages)


def _history_rewritten(plan: ChatPlan, template_src: str | None) -> ChatPlan:
    """No tools offered this turn (none sent, or tool_choice "none"), but earlier turns may hold
    calls and their results, as an agent's closing turn does: a template without tool support
    cannot render them (an assistant turn of null content failed inside it), so they are
    rewritten as with tools offered (apply_tool_prompt), minus the tools block."""
    if template_supports_tools(template_src) or not _has_tool_turns(plan.messages):
        return plan
    try:
        plan.messages = apply_tool_prompt(plan.messages, None)
    except ValueError as e:
        raise bad_value(e) from None
    return plan


def plan_chat(fields: dict[str, Any], template_src: str | None, tool_parser: str | None,
              reasoning_parser: str | None) -> ChatPlan:
    messages = fields["messages"]
    kwargs = dict(fields.get("chat_template_kwargs") or {})
    thinking = kwargs.get("enable_thinking", kwargs.get("thinking", True))
    plan = ChatPlan(messages, kwargs, None, None, reasoning_parser, bool(thinking), None)
    tools, choice = fields.get("tools"), fields.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice: needs a non-empty tools list", param="tool_choice")
        return _history_rewritten(plan, template_src)
    try:
        functions = validate_tools(tools)
    except ValueError as e:
        raise bad_value(e) from None
    for i, fn in enumerate(functions):  # a schema xgrammar cannot read is a 400, forced or not
        if fn.get("parameters"):
            check_grammar(GrammarSpec.json_schema(fn["parameters"]), f"tools[{i}].function.parameters")
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        forced = [_named_choice(choice, functions)]
    elif choice in ("none", "auto", "required"):
        forced = functions if choice == "required" else None
    else:
        raise APIError(400, f"tool_choice: expected 'none', 'auto', 'required' or a named function, got {choice!r}",
                       param="tool_choice")
    if choice == "none":
        return _history_rewritten(plan, template_src)
    if forced is not None and any(fields.get(f) is not None for f in ("response_format", "regex", "ebnf")):
        raise APIError(400, "tool_choice: a forced tool call cannot be combined with response_format",
                       param="tool_choice")
    taught = not template_supports_tools(template_src)  # the model knows the call format from our prompt only
    if not taught:
        if tool_parser is None:
            raise APIError(400, "tools: this server reads no tool calls; start it with --tool-call-parser",
                           param="tools")
        plan.template_kwargs["tools"] = tools
    else:  # the template cannot show tools: teach them in the system prompt, in the hermes format
        try:
            plan.messages = apply_tool_prompt(messages, tools, choice)
        except ValueError as e:
            raise bad_value(e) from None
        tool_parser = "hermes"
    plan.tools, plan.tool_parser = tools, tool_parser
    # Under "auto" no grammar holds the model to one call: the parser keeps the first, in the stream
    # and the whole answer alike (vLLM keeps the first too).
    one_call = not fields.get("parallel_tool_calls", True)
    plan.max_calls = 1 if one_call else None
    if forced is not None:
        parallel = choice == "required" and not one_call  # named: one call
        plan.forced_grammar = forced_calls(tool_parser, forced, parallel, layout=not taught)
    return plan
