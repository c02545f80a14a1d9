"""Request checks shared by the engine (which enforces them) and the API process (which makes
them before a stream starts, so a bad request still gets a 400). Messages start with the field."""
from __future__ import annotations

from ketch.sampling.params import SamplingParams


def validate_request(prompt_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                     kv_capacity: int, prompt_field: str = "prompt") -> None:
    if not prompt_ids:
        raise ValueError(f"{prompt_field}: must not be empty")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"{prompt_field}: token ids must be in [0, {vocab_size})")
    params.validate(vocab_size)
    if len(prompt_ids) >= max_model_len:  # the prompt alone leaves no room for a token
        raise ValueError(f"{prompt_field}: the prompt has {len(prompt_ids)} tokens; the context length is "
                         f"{max_model_len}, so it may have at most {max_model_len - 1}")
    total = len(prompt_ids) + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"max_tokens: prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the context length ({max_model_len})"
        )
    if total > kv_capacity:
        raise ValueError(
            f"max_tokens: prompt + max_tokens = {total} tokens exceeds the KV cache capacity ({kv_capacity} tokens)"
        )
