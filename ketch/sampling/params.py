"""SamplingParams: what one request asks of the sampler and of the stop checks.

Validation raises ValueError with a message that starts with the offending field's name, so
the server can turn it into an OpenAI-style 400 without parsing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ketch.sampling.grammar.spec import GrammarSpec

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_PENALTY = 2.0  # frequency/presence, OpenAI's range


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
        else:
            self.stop = list(self.stop)
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
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.temperature >= 0:  # written this way so NaN fails too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0 or math.isinf(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None and (type(self.seed) is not int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
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
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        for token_id in self.stop_token_ids:
            _check_token_id("stop_token_ids", token_id, vocab_size)
        for token_id, bias in (self.logit_bias or {}).items():
            _check_token_id("logit_bias", token_id, vocab_size)
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-100, 100], got {bias} for {token_id}"
                )


def _normalize_logit_bias(bias: dict) -> dict[int, float]:
    """OpenAI JSON sends {"50256": -100}; keys become ints, values floats."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
            out[token_id] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {key!r}: {value!r}")
    return out


def _check_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")


def _check_token_id(name: str, token_id: object, vocab_size: int | None) -> None:
    _check_int(name, token_id)
    if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"{name} token id {token_id} out of range {bound}")
