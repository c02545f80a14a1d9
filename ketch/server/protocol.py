"""Request bodies → (prompt, SamplingParams), with OpenAI-style 400s that name the field.

Bodies are checked by hand rather than by pydantic models: the first bad field becomes one
`param`, unknown fields are refused by name instead of being ignored, and SamplingParams stays
the single place where value ranges are checked.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ketch.sampling.grammar.spec import GrammarSpec
from ketch.sampling.params import SamplingParams
from ketch.server.errors import APIError, bad_value

_NUM = (int, float)
MAX_TIMEOUT_S = 24 * 3600.0
# field → (accepted types, SamplingParams field it feeds or None)
_SAMPLING: dict[str, tuple[tuple[type, ...], str | None]] = {
    "n": ((int,), "n"),
    "temperature": (_NUM, "temperature"),
    "top_p": (_NUM, "top_p"),
    "top_k": ((int,), "top_k"),
    "min_p": (_NUM, "min_p"),
    "repetition_penalty": (_NUM, "repetition_penalty"),
    "frequency_penalty": (_NUM, "frequency_penalty"),
    "presence_penalty": (_NUM, "presence_penalty"),
    "seed": ((int,), "seed"),
    "logit_bias": ((dict,), "logit_bias"),
    "stop": ((str, list), "stop"),
    "stop_token_ids": ((list,), "stop_token_ids"),
    "ignore_eos": ((bool,), "ignore_eos"),
    "max_tokens": ((int,), "max_tokens"),
    "min_tokens": ((int,), "min_tokens"),
    "skip_special_tokens": ((bool,), "skip_special_tokens"),
}
_COMMON = {"model": (str,), "stream": (bool,), "stream_options": (dict,), "user": (str,),
           "timeout": _NUM,  # seconds: the request's own deadline (ketch's extension)
           # ketch's extensions for a gateway's mid-stream failover (README, "Resuming a stream"):
           "return_token_ids": (bool,),  # each choice (chunk) carries the token ids of its text
           "resume": (dict,),  # {"generated_token_ids": [...]}: continue a stream that made them
           # PD disaggregation (server/pd.py): where the prefill half is, the room pairing the halves
           "bootstrap_host": (str,), "bootstrap_port": (int,), "bootstrap_room": (int,)}
_GRAMMAR = {"response_format": (dict,), "regex": (str,), "ebnf": (str,)}
CHAT_FIELDS = {**{k: v[0] for k, v in _SAMPLING.items()}, **_COMMON, **_GRAMMAR, "messages": (list,),
               "max_completion_tokens": (int,), "logprobs": (bool,), "top_logprobs": (int,),
               "tools": (list,), "tool_choice": (str, dict), "parallel_tool_calls": (bool,),
               "chat_template_kwargs": (dict,)}
COMPLETION_FIELDS = {**{k: v[0] for k, v in _SAMPLING.items()}, **_COMMON, **_GRAMMAR,
                     "prompt": (str, list), "logprobs": (int,), "echo": (bool,)}
# messages with the chat route's prompt-shaping fields: /tokenize counts the prompt chat would build
TOKENIZE_FIELDS = {"model": (str,), "prompt": (str,), "messages": (list,), "add_special_tokens": (bool,),
                   "tools": (list,), "tool_choice": (str, dict), "chat_template_kwargs": (dict,)}
DETOKENIZE_FIELDS = {"model": (str,), "tokens": (list,)}
# the chat template's own arguments: a chat_template_kwargs key may not replace them
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


# OpenAI fields that SDKs send explicitly, accepted where their value asks for nothing ketch would
# do differently: (the check, what is accepted)
_NO_EFFECT: dict[str, tuple[Callable[[Any, dict], bool], str]] = {
    "store": (lambda v, body: v is False, "only false (nothing is stored)"),
    "metadata": (lambda v, body: isinstance(v, dict), "an object (tags of stored completions; ignored)"),
    "service_tier": (lambda v, body: v in ("auto", "default"), "only 'auto' or 'default'"),
    "best_of": (lambda v, body: type(v) is int and v == (body.get("n") or 1),
                "only equal to n (no extra samples are drawn to rank)"),
}


def check_fields(body: Any, schema: dict[str, tuple[type, ...]]) -> dict[str, Any]:
    """The body as a dict of known fields with the right JSON types; null means 'not given', for
    any field (SDKs send optional fields as null)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    out = {}
    for key, value in body.items():
        if value is None:
            continue
        if key in _NO_EFFECT and key not in schema:
            accepts, what = _NO_EFFECT[key]
            if not accepts(value, body):
                raise APIError(400, f"{key}: {what}, got {value!r}", param=key, code="unsupported_value")
            continue
        if key not in schema:
            raise APIError(400, f"{key}: unsupported field", param=key, code="unsupported_field")
        types = schema[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise APIError(400, f"{key}: expected {names}, got {type(value).__name__}", param=key, code="invalid_type")
        out[key] = value
    opts = out.get("stream_options")
    if opts is not None:
        if not out.get("stream"):
            raise APIError(400, "stream_options: only allowed with stream=true", param="stream_options")
        unknown = set(opts) - {"include_usage"}
        if unknown or not isinstance(opts.get("include_usage", False), bool):
            raise APIError(400, "stream_options: only include_usage (a bool) is supported", param="stream_options")
    reserved = RESERVED_TEMPLATE_KWARGS.intersection(out.get("chat_template_kwargs") or ())
    if reserved:
        raise APIError(400, f"chat_template_kwargs: {sorted(reserved)} are set by the server, not the request",
                       param="chat_template_kwargs")
    timeout = out.get("timeout")
    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
        raise APIError(400, f"timeout: must be in (0, {MAX_TIMEOUT_S}] seconds, got {timeout}", param="timeout")
    return out


def sampling_params(fields: dict[str, Any], default_max_tokens: int, grammar: GrammarSpec | None = None,
                    max_n: int | None = None) -> SamplingParams:
    """SamplingParams from checked fields (the prompt is tokenized first: chat's default depends on it)."""
    n = fields.get("n", 1)
    if max_n is not None and n > max_n:  # before anything is built per sample
        raise APIError(400, f"n: at most {max_n} samples per prompt on this server (--max-n), got {n}", param="n")
    kwargs: dict[str, Any] = {}
    for key, (_, target) in _SAMPLING.items():
        if key in fields and target is not None:
            kwargs[target] = fields[key]
    if "max_completion_tokens" in fields:
        kwargs["max_tokens"] = fields["max_completion_tokens"]
    logprobs = fields.get("logprobs")
    if fields.get("top_logprobs") is not None and logprobs is not True:
        raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
    if isinstance(logprobs, bool):  # chat: a flag plus top_logprobs
        kwargs["logprobs"] = logprobs
        kwargs["top_logprobs"] = fields.get("top_logprobs", 0)
    elif isinstance(logprobs, int):  # completions: how many alternatives per token
        kwargs["logprobs"] = True
        kwargs["top_logprobs"] = logprobs
    kwargs.setdefault("max_tokens", max(default_max_tokens, 1))
    kwargs["grammar"] = grammar
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise as_sent(bad_value(e), fields) from None


def as_sent(error: APIError, fields: dict[str, Any]) -> APIError:
    """The error with the fields named as the client sent them: max_completion_tokens (the engine's
    max_tokens, wherever its message names it), a completions request's logprobs count (the
    engine's top_logprobs)."""
    if "max_completion_tokens" in fields:  # it wins over max_tokens (sampling_params)
        error.message = re.sub(r"\bmax_tokens\b", "max_completion_tokens", error.message)
        if error.param == "max_tokens":
            error.param = "max_completion_tokens"
    if error.param == "top_logprobs" and type(fields.get("logprobs")) is int:
        error.message = error.message.replace("top_logprobs", "logprobs", 1)
        error.param = "logprobs"
    return error


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """string | [string] | [int] | [[int]] → a list of prompts."""
    if prompt is None:
        raise APIError(400, "prompt: required", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise APIError(400, "prompt: expected a string, a list of strings, token ids or a list of token id lists",
                   param="prompt")


RESUME_FIELD = "resume.generated_token_ids"
REGENERATE_FIELD = "resume.regenerate_last"


def resume_token_ids(fields: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    """The `resume` extension (None without it) as (ids to prefill, ids to regenerate silently):
    `regenerate_last` m splits the last m ids off (README, "Resuming a stream"). Its shape only:
    the values are the engine's checks (validate_request), made before the stream starts."""
    resume = fields.get("resume")
    if resume is None:
        return None
    unknown = set(resume) - {"generated_token_ids", "regenerate_last"}
    if unknown:
        raise APIError(400, f"resume: unsupported field {sorted(unknown)[0]!r}; it takes generated_token_ids "
                       f"and regenerate_last", param="resume", code="unsupported_field")
    ids = resume.get("generated_token_ids")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise APIError(400, f"{RESUME_FIELD}: expected a list of token ids (integers)", param=RESUME_FIELD,
                       code="invalid_type")
    m = resume.get("regenerate_last", 0)
    if type(m) is not int or not 0 <= m <= len(ids):
        raise APIError(400, f"{REGENERATE_FIELD}: expected an integer from 0 to the number of generated_token_ids "
                       f"({len(ids)}), got {m!r}", param=REGENERATE_FIELD)
    if not fields.get("stream"):
        raise APIError(400, "resume: continues a stream, so it needs stream=true (a whole answer that failed is "
                       "simply asked again)", param="resume")
    return ids[:len(ids) - m], ids[len(ids) - m:]
