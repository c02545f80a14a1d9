"""What the engine reports after a step: token deltas per sample, with logprobs when asked."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class EngineOutput:
    request_id: str
    index: int  # which of the n samples
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
