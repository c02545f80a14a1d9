"""Model outputs for tests/test_parsers.py: realistic ones per parser, then malformed ones.

Each case: (id, parser kwargs, output text, expected final message). Expected content None means
"no content"; calls are (name, arguments as a Python object). Cut cases end inside a call (as
max_tokens leaves them): `cut_call` is then the last call, (name, its unfinished argument text).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time", "run", "translate", "search")
]

# DeepSeek-V3 markers (fullwidth bars, lower one-eighth blocks), as in its chat template.
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


@dataclass(frozen=True)
class Case:
    id: str
    kwargs: dict[str, Any]
    text: str
    content: str | None
    reasoning: str | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    malformed: bool = False  # a call may have been announced on the stream before it broke
    cut_call: tuple[str, str] | None = None  # a last call cut in its arguments (not in `calls`)


def _j(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def hermes(name: str, args: Any) -> str:
    return f"<tool_call>\n{_j({'name': name, 'arguments': args})}\n</tool_call>"


def ds_call(name: str, args: Any) -> str:
    return f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{_j(args)}\n```{DS_CALL_END}"


WEATHER = {"city": "Paris", "unit": "celsius"}
TRICKY = {
    "code": 'if (a) { b("}"); }\n</tool_call> [ARGS] ```',
    "nested": {"x": [1, {"y": "}]"}], "z": None, "t": True, "n": -1.5e-3},
    "quote": 'say "hi" \\ there',
}
UNICODE = {"text": "héllo 你好 🙂", "to": "日本語"}

H, L, M, D = ({"tool_parser": p, "tools": TOOLS} for p in ("hermes", "llama3", "mistral", "deepseek-v3"))

GOOD: list[Case] = [
    # --- hermes ---------------------------------------------------------------------------------
    Case("hermes-content", H, "Hello! How can I help you today?\n", "Hello! How can I help you today?\n"),
    Case("hermes-one", H, hermes("get_weather", WEATHER), None, calls=[("get_weather", WEATHER)]),
    Case(
        "hermes-two",
        H,
        "Let me check both.\n" + hermes("get_weather", WEATHER) + "\n" + hermes("get_time", {"tz": "CET"}),
        "Let me check both.",
        calls=[("get_weather", WEATHER), ("get_time", {"tz": "CET"})],
    ),
    Case("hermes-tricky", H, hermes("run", TRICKY), None, calls=[("run", TRICKY)]),
    Case("hermes-unicode", H, "Voilà 🙂 " + hermes("translate", UNICODE), "Voilà 🙂", calls=[("translate", UNICODE)]),
    Case(
        "hermes-reasoning-content",
        {**H, "reasoning_parser": "qwen3"},
        "<think>\nThe user greets me.\n\nI greet back.\n</think>\n\nHello there!",
        "Hello there!",
        reasoning="The user greets me.\n\nI greet back.",
    ),
    Case(
        "hermes-reasoning-calls",
        {**H, "reasoning_parser": "qwen3"},
        "<think>\nNeed the weather and the time.\n</think>\n\n"
        + hermes("get_weather", WEATHER)
        + "\n"
        + hermes("get_time", {}),
        None,
        reasoning="Need the weather and the time.",
        calls=[("get_weather", WEATHER), ("get_time", {})],
    ),
    Case(
        "hermes-string-args-and-no-args",
        H,
        '<tool_call>{"name": "search", "parameters": "{\\"q\\": \\"x\\"}"}</tool_call><tool_call>{"name": "get_time"}</tool_call>',
        None,
        calls=[("search", {"q": "x"}), ("get_time", {})],
    ),
    Case("hermes-after-call", H, hermes("get_time", {}) + "\n\nDone.\n", "Done.\n", calls=[("get_time", {})]),
    Case("hermes-not-a-tag", H, "a < b, <tool> and <tool_", "a < b, <tool> and <tool_"),
    # --- llama3 ---------------------------------------------------------------------------------
    Case("llama3-content", L, "The capital of France is Paris.", "The capital of France is Paris."),
    Case("llama3-one", L, _j({"name": "get_weather", "parameters": WEATHER}), None, calls=[("get_weather", WEATHER)]),
    Case(
        "llama3-python-tag",
        L,
        "<|python_tag|>" + _j({"name": "get_weather", "parameters": WEATHER}),
        None,
        calls=[("get_weather", WEATHER)],
    ),
    Case(
        "llama3-two",
        L,
        _j({"name": "get_weather", "parameters": WEATHER}) + "; " + _j({"name": "get_time", "parameters": {"tz": "UTC"}}),
        None,
        calls=[("get_weather", WEATHER), ("get_time", {"tz": "UTC"})],
    ),
    Case("llama3-tricky", L, _j({"name": "run", "parameters": TRICKY}), None, calls=[("run", TRICKY)]),
    Case("llama3-unicode", L, _j({"type": "function", "name": "translate", "parameters": UNICODE}), None, calls=[("translate", UNICODE)]),
    Case("llama3-json-content", L, '{"answer": 42, "unit": "m"}', '{"answer": 42, "unit": "m"}'),
    Case("llama3-json-later", L, 'JSON: {"name": "run", "parameters": {}}', 'JSON: {"name": "run", "parameters": {}}'),
    Case(
        "llama3-reasoning-content",
        {**L, "reasoning_parser": "deepseek-r1"},
        "Okay, a greeting.\n</think>\n\nHi!",
        "Hi!",
        reasoning="Okay, a greeting.",
    ),
    Case(
        "llama3-reasoning-call",
        {**L, "reasoning_parser": "deepseek-r1"},
        "<think>\nOkay, weather.\n</think>\n\n" + _j({"name": "get_weather", "parameters": WEATHER}),
        None,
        reasoning="Okay, weather.",
        calls=[("get_weather", WEATHER)],
    ),
    # --- mistral --------------------------------------------------------------------------------
    Case("mistral-content", M, "Bonjour ! [INST] is not a call.", "Bonjour ! [INST] is not a call."),
    Case(
        "mistral-list-one",
        M,
        "[TOOL_CALLS][" + _j({"name": "get_weather", "arguments": WEATHER}) + "]",
        None,
        calls=[("get_weather", WEATHER)],
    ),
    Case(
        "mistral-list-two",
        M,
        "[TOOL_CALLS] [" + _j({"name": "get_weather", "arguments": WEATHER, "id": "abc123def"}) + ", "
        + _j({"name": "get_time", "arguments": {}}) + "]",
        None,
        calls=[("get_weather", WEATHER), ("get_time", {})],
    ),
    Case(
        "mistral-list-no-close",
        M,
        "[TOOL_CALLS][" + _j({"name": "get_time", "arguments": {}}) + "\n",
        None,
        calls=[("get_time", {})],
    ),
    Case(
        "mistral-v13-two",
        M,
        "Checking.[TOOL_CALLS]get_weather[ARGS]" + _j(WEATHER) + "[TOOL_CALLS]get_time[ARGS]{}",
        "Checking.",
        calls=[("get_weather", WEATHER), ("get_time", {})],
    ),
    Case(
        "mistral-v11-call-id",
        M,
        "[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]" + _j(WEATHER),
        None,
        calls=[("get_weather", WEATHER)],
    ),
    Case("mistral-tricky", M, "[TOOL_CALLS]run[ARGS]" + _j(TRICKY), None, calls=[("run", TRICKY)]),
    Case("mistral-unicode", M, "[TOOL_CALLS]translate" + _j(UNICODE), None, calls=[("translate", UNICODE)]),
    Case(
        "mistral-reasoning-content",
        {**M, "reasoning_parser": "qwen3"},
        "<think>Simple.</think>Oui.",
        "Oui.",
        reasoning="Simple.",
    ),
    Case(
        "mistral-reasoning-call",
        {**M, "reasoning_parser": "qwen3"},
        "<think>\nCall it.\n</think>\n[TOOL_CALLS]get_weather[ARGS]" + _j(WEATHER),
        None,
        reasoning="Call it.",
        calls=[("get_weather", WEATHER)],
    ),
    # --- deepseek-v3 ----------------------------------------------------------------------------
    Case("deepseek-content", D, "你好！有什么可以帮你的吗？", "你好！有什么可以帮你的吗？"),
    Case(
        "deepseek-one",
        D,
        DS_CALLS_BEGIN + ds_call("get_weather", WEATHER) + DS_CALLS_END,
        None,
        calls=[("get_weather", WEATHER)],
    ),
    Case(
        "deepseek-two",
        D,
        "Let me look.\n" + DS_CALLS_BEGIN + ds_call("get_weather", WEATHER) + "\n" + ds_call("get_time", {}) + DS_CALLS_END,
        "Let me look.",
        calls=[("get_weather", WEATHER), ("get_time", {})],
    ),
    Case(
        "deepseek-v31-form",
        D,
        DS_CALLS_BEGIN + DS_CALL_BEGIN + "get_weather" + DS_SEP + _j(WEATHER) + DS_CALL_END + DS_CALLS_END,
        None,
        calls=[("get_weather", WEATHER)],
    ),
    Case(
        "deepseek-tricky",
        D,
        DS_CALLS_BEGIN + ds_call("run", {**TRICKY, "end": DS_CALL_END}) + DS_CALLS_END,
        None,
        calls=[("run", {**TRICKY, "end": DS_CALL_END})],
    ),
    Case(
        "deepseek-unicode",
        D,
        "好的 " + DS_CALLS_BEGIN + ds_call("translate", UNICODE) + DS_CALLS_END + "\n完成",
        "好的完成",
        calls=[("translate", UNICODE)],
    ),
    Case(
        "deepseek-no-calls-end",
        D,
        DS_CALLS_BEGIN + ds_call("get_time", {}) + "\n",
        None,
        calls=[("get_time", {})],
    ),
    Case(
        "deepseek-reasoning-content",
        {**D, "reasoning_parser": "deepseek-r1"},
        "Let me think.\n</think>\n\nAnswer: 4.",
        "Answer: 4.",
        reasoning="Let me think.",
    ),
    Case(
        "deepseek-reasoning-calls",
        {**D, "reasoning_parser": "deepseek-r1"},
        "<think>\nTwo calls.\n</think>\n\n" + DS_CALLS_BEGIN + ds_call("get_weather", WEATHER) + "\n"
        + ds_call("get_time", {"tz": "CET"}) + DS_CALLS_END,
        None,
        reasoning="Two calls.",
        calls=[("get_weather", WEATHER), ("get_time", {"tz": "CET"})],
    ),
    # --- reasoning alone ------------------------------------------------------------------------
    Case("r1-explicit", {"reasoning_parser": "deepseek-r1"}, "<think>a</think>b", "b", reasoning="a"),
    Case("r1-truncated", {"reasoning_parser": "deepseek-r1"}, "<think>\nstill thinking </thi", None, reasoning="still thinking </thi"),
    Case("r1-empty-think", {"reasoning_parser": "deepseek-r1"}, "<think>\n\n</think>\n\nHi", "Hi"),
    Case("r1-thinking-off", {"reasoning_parser": "deepseek-r1", "enable_thinking": False}, "a</think>b", "a</think>b"),
    Case("qwen3-no-think", {"reasoning_parser": "qwen3"}, "  Hi </think> there", "  Hi </think> there"),
    Case("qwen3-not-a-tag", {"reasoning_parser": "qwen3"}, "<thinking>x</thinking>", "<thinking>x</thinking>"),
    Case("qwen3-thinking-off", {"reasoning_parser": "qwen3", "enable_thinking": False}, "<think>x</think>y", "<think>x</think>y"),
    Case("no-parsers", {}, " <tool_call> as text\n", " <tool_call> as text\n"),
]

_GOOD_LLAMA = _j({"name": "get_time", "parameters": {}})
_DS_RUN = DS_CALL_BEGIN + "function" + DS_SEP + "run\n```json\n"

# The output ends inside a call (max_tokens): once its name was read (the stream announced it), the
# call stays with what was read of its arguments; before that, its text is content.
CUT: list[Case] = [
    Case("hermes-cut-in-args", H, 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Par', "Sure",
         cut_call=("get_weather", '{"city": "Par')),
    Case("hermes-second-cut", H, hermes("get_weather", WEATHER) + "\n" + hermes("get_time", {"tz": "CET"}).split("ET")[0], None,
         calls=[("get_weather", WEATHER)], cut_call=("get_time", '{"tz": "C')),
    Case("hermes-cut-after-name", H, '<tool_call>{"name": "get_time", ', None, cut_call=("get_time", "")),
    Case("hermes-cut-in-name", H, 'Sure <tool_call>{"name": "get_wea', 'Sure <tool_call>{"name": "get_wea'),
    Case("hermes-no-close", H, '<tool_call>{"name": "get_time", "arguments": {}}', None, calls=[("get_time", {})]),
    Case("llama3-cut-in-args", L, '{"name": "get_weather", "parameters": {"city": "Pa', None, cut_call=("get_weather", '{"city": "Pa')),
    Case("mistral-cut-in-args", M, '[TOOL_CALLS]run[ARGS]{"code": "x', None, cut_call=("run", '{"code": "x')),
    Case("mistral-list-cut", M, '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "run", "argu', None,
         calls=[("get_time", {})], cut_call=("run", "")),
    Case("deepseek-cut-in-close", D, DS_CALLS_BEGIN + ds_call("get_time", {})[:-12], None, calls=[("get_time", {})]),
    Case("deepseek-good-then-cut", D, DS_CALLS_BEGIN + ds_call("get_time", {}) + "\n" + _DS_RUN + '{"a"', None,
         calls=[("get_time", {})], cut_call=("run", '{"a"')),
]

BAD: list[Case] = [
    Case("hermes-bad-json", H, '<tool_call>{"name": "run", "arguments": {a: 1}}</tool_call> x', '<tool_call>{"name": "run", "arguments": {a: 1}}</tool_call> x', malformed=True),
    Case("hermes-unknown-name", H, "\n" + hermes("launch", {}), "\n" + hermes("launch", {}), malformed=True),
    Case("hermes-junk-before-close", H, '<tool_call>{"name": "run", "arguments": {}} !</tool_call>', '<tool_call>{"name": "run", "arguments": {}} !</tool_call>', malformed=True),
    Case(
        "hermes-good-then-bad",
        H,
        hermes("get_time", {}) + '\n<tool_call>{"name": "run", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "run", "arguments": [1]}</tool_call>',
        calls=[("get_time", {})],
        malformed=True,
    ),
    Case("llama3-no-parameters", L, '{"name": "get_time"}', '{"name": "get_time"}', malformed=True),
    Case("llama3-unknown-name", L, '{"name": "launch", "parameters": {}}', '{"name": "launch", "parameters": {}}', malformed=True),
    Case("llama3-bad-separator", L, _GOOD_LLAMA + "; hello", "; hello", calls=[("get_time", {})], malformed=True),
    Case("mistral-bad-marker", M, "[TOOL_CALLS]get_time[FOO]{}", "[TOOL_CALLS]get_time[FOO]{}", malformed=True),
    Case("mistral-bad-json", M, '[TOOL_CALLS]run[ARGS]{"a": tru}', '[TOOL_CALLS]run[ARGS]{"a": tru}', malformed=True),
    Case(
        "deepseek-wrong-type",
        D,
        DS_CALLS_BEGIN + ds_call("get_time", {}).replace("function", "procedure"),
        DS_CALLS_BEGIN + ds_call("get_time", {}).replace("function", "procedure"),
        malformed=True,
    ),
]

ALL = GOOD + CUT + BAD
