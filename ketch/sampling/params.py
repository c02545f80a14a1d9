"""SamplingParams: what one request asks of the sampler and of the stop checks.

Validation raises ValueError with a message that starts with the offending field's name, so
the server can turn it into an OpenAI-style 400 without parsing.
"""
from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

from ketch.sampling.grammar.spec import GrammarSpec

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_PENALTY = 2.0  # frequency/presence, OpenAI's range
MAX_TEMPERATURE = 100.0  # far above any useful value (OpenAI stops at 2), but finite
MAX_REPETITION_PENALTY = 100.0
MAX_STOP_STRINGS = 16  # OpenAI allows 4; every stop string is checked against every new token
MAX_STOP_LENGTH = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # integers must fit the wire (msgpack) and torch


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None  # always a list after __post_init__
    stop_token_ids: list[int] | None = None  # always a list after __post_init__
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None  # constrain the output (JSON schema, regex, EBNF, ...)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)
        self.grammar = GrammarSpec.coerce(self.grammar)
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Repetition, frequency or presence penalty: sampling reads the tokens so far."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    def validate(self, vocab_size: int | None = None) -> None:
        """Structural checks always; token-id range checks only when vocab_size is known."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            _check_number(name, getattr(self, name))
        for name in ("ignore_eos", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))
        if type(self.logprobs) is not bool:
            hint = " (how many alternatives: top_logprobs)" if type(self.logprobs) is int else ""
            raise ValueError(f"logprobs must be a bool{hint}, got {self.logprobs!r}")
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # written this way so NaN fails too
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                             f"got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            if type(self.seed) is not int:
                raise ValueError(f"seed must be an int or None, got {self.seed!r}")
            # sample i of n uses seed + i: every one of them must be an int64
            if not INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1):
                raise ValueError(f"seed must be in [-2**63, 2**63 - n] = [{INT64_MIN}, {INT64_MAX - (self.n - 1)}], "
                                 f"got {self.seed}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        _check_int("top_logprobs", self.top_logprobs)
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        # lists after __post_init__; a field set later is checked here, not normalised
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), list):
                raise ValueError(f"{name} must be a list, got {type(getattr(self, name)).__name__} "
                                 f"(set after construction: pass it to SamplingParams(...) instead)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
            if len(s) > MAX_STOP_LENGTH:
                raise ValueError(f"stop: a stop string may have at most {MAX_STOP_LENGTH} characters, got {len(s)}")
            _check_encodable("stop", s)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for token_id in self.stop_token_ids:
            _check_token_id("stop_token_ids", token_id, vocab_size)
        for token_id, bias in (self.logit_bias or {}).items():
            _check_token_id("logit_bias", token_id, vocab_size)
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-100, 100], got {bias} for {token_id}"
                )


# one optional minus and ASCII digits (str.isdigit() also takes "²" and "５", which int() refuses
# or reads as another token; a range error names a negative id later)
_DECIMAL_ID = re.compile(r"\s*-?[0-9]+\s*")


def _normalize_logit_bias(bias: object) -> dict[int, float]:
    """OpenAI JSON sends {"50256": -100}; keys become ints (from ints or decimal strings, never
    from floats or bools, which would name another token), values floats."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        whole = (isinstance(key, numbers.Integral) and not isinstance(key, bool)) or \
            (isinstance(key, str) and _DECIMAL_ID.fullmatch(key) is not None)
        if not whole or not _is_number(value):
            raise ValueError(f"logit_bias must map token ids to numbers, got {key!r}: {value!r}")
        out[int(key)] = float(value)
    return out


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy's scalars too


def _check_number(name: str, value: object) -> None:
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if type(value) is not bool:
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _check_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must fit in 64 bits, got an integer of {value.bit_length()} bits")


def _check_encodable(name: str, text: str) -> None:
    """Lone surrogates (JSON's "\\ud800") cannot be encoded as UTF-8: refuse them here, by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name}: contains a lone surrogate (not valid Unicode text)") from None


def _check_token_id(name: str, token_id: object, vocab_size: int | None) -> None:
    _check_int(name, token_id)
    if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
        bound = f"out of range [0, {vocab_size})" if vocab_size is not None else "must be >= 0"
        raise ValueError(f"{name} token id {token_id} {bound}")
