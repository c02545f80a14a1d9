"""Request checks shared by the engine (which enforces them) and the API process (which makes
them before a stream starts, so a bad request still gets a 400). Messages start with the field."""
from __future__ import annotations

import numbers
import re
from collections.abc import Sequence

from ketch.sampling.params import SamplingParams


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    """Integers (numpy's too; not bools, floats that would be truncated, or anything else) in
    [0, vocab_size)."""
    if not all(type(t) is int for t in ids):  # the common case in one pass; else look closer
        bad = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad:
            raise ValueError(f"{field}: token ids must be integers, got {bad[0]!r}")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"{field}: token ids must be in [0, {vocab_size})")


def validate_request(prompt_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                     kv_capacity: int, prompt_field: str = "prompt", generated: Sequence[int] = (),
                     eos_ids: Sequence[int] = (), generated_field: str = "generated_token_ids",
                     prefill_only: bool = False) -> None:
    """prefill_only: a PD prefill server's check. It holds KV for the prompt and the first token
    only (pd_prefill.PrefillSends.start: max_len = prompt + 1), so its KV capacity bounds that; the
    whole prompt + max_tokens is the decode server's to hold (and the context length both sides')."""
    if prompt_ids is None or isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
        # (None, text, a bare int: not a TypeError from len() inside the engine)
        raise ValueError(f"{prompt_field}: must be a sequence of token ids, got {type(prompt_ids).__name__}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params: must be a SamplingParams, got {type(params).__name__}")
    if len(prompt_ids) == 0:  # (a numpy array has no truth value)
        raise ValueError(f"{prompt_field}: must not be empty")
    check_token_ids(prompt_field, prompt_ids, vocab_size)
    params.validate(vocab_size)
    if len(prompt_ids) >= max_model_len:  # the prompt alone leaves no room for a token
        raise ValueError(f"{prompt_field}: the prompt has {len(prompt_ids)} tokens; the context length is "
                         f"{max_model_len}, so it may have at most {max_model_len - 1}")
    # max_tokens bounds the whole output, resumed tokens included, so this bounds a resumed sequence too
    total = len(prompt_ids) + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"max_tokens: prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the context length ({max_model_len})"
        )
    if prefill_only and len(prompt_ids) + 1 > kv_capacity:
        raise ValueError(f"{prompt_field}: the prompt + its first token = {len(prompt_ids) + 1} tokens exceeds the "
                         f"KV cache capacity of this prefill server ({kv_capacity} tokens)")
    if not prefill_only and total > kv_capacity:
        raise ValueError(
            f"max_tokens: prompt + max_tokens = {total} tokens exceeds the KV cache capacity ({kv_capacity} tokens)"
        )
    if len(generated):
        validate_resume(generated, params, vocab_size=vocab_size, eos_ids=eos_ids, field=generated_field)


def validate_resume(generated: Sequence[int], params: SamplingParams, *, vocab_size: int,
                    eos_ids: Sequence[int], field: str) -> None:
    """The outputs a resumed stream already has (engine README, "Resuming a stream") must be ones
    the original request could have produced and then gone on from."""
    if params.n != 1:
        raise ValueError(f"{field}: a stream is resumed one sample at a time (n = 1; sample i of a seeded "
                         f"request is seed + i), got n = {params.n}")
    check_token_ids(field, generated, vocab_size)
    if len(generated) >= params.max_tokens:
        raise ValueError(f"{field}: {len(generated)} tokens were generated already, and max_tokens "
                         f"({params.max_tokens}) counts them: nothing would be left to generate")
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    for i, token in enumerate(generated):
        if token in stops and i + 1 >= params.min_tokens:
            raise ValueError(f"{field}: token {i} ({token}) is a stop token, so the stream ended there")


ROOM_LIMIT = 1 << 63  # bootstrap_room: 0 <= room < 2^63 (SGLang's range; a signed 64-bit int)


# a DNS name (letters, digits, '-', '.') or an IPv4 / IPv6 address (hex digits, ':', '.', a
# bracketed form): what a tcp:// address can carry. Anything else ("a b", "h/x") once reached the
# decode side's socket connect and killed its transport thread, failing every PD request after it.
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[?[0-9A-Fa-f:.]{2,45}\]?")


def validate_bootstrap(mode: str, host: str | None, port: int | None, room: int | None, params: SamplingParams,
                       generated: Sequence[int] = ()) -> None:
    """A request's PD fields against the server's --disaggregation-mode: required on a prefill or a
    decode server, refused on a colocated one; and what PD serves (one sample, no constrained
    output, no logprobs, no resumed stream yet)."""
    given = [name for name, v in (("bootstrap_host", host), ("bootstrap_port", port), ("bootstrap_room", room))
             if v is not None]
    if mode == "null":
        if given:
            raise ValueError(f"{given[0]}: this server is not part of a PD pair (--disaggregation-mode null); "
                             f"send the request without bootstrap_host, bootstrap_port and bootstrap_room")
        return
    if len(given) < 3:
        missing = next(n for n in ("bootstrap_host", "bootstrap_port", "bootstrap_room") if n not in given)
        raise ValueError(f"{missing}: required on a {mode} server (--disaggregation-mode {mode})")
    if not isinstance(host, str) or not _HOST.fullmatch(host):
        raise ValueError(f"bootstrap_host: the prefill server's bootstrap host name or IP address, got {host!r}")
    if type(port) is not int or not 1 <= port <= 65535:
        raise ValueError(f"bootstrap_port: an int in [1, 65535], got {port!r}")
    if type(room) is not int or not 0 <= room < ROOM_LIMIT:
        raise ValueError(f"bootstrap_room: an int in [0, 2^63), got {room!r}")
    if params.n != 1:
        raise ValueError(f"n: a PD request has one sample (n = 1), got {params.n}")
    if params.grammar is not None:
        field = params.grammar.kind if params.grammar.kind in ("regex", "ebnf") else "response_format"
        raise ValueError(f"{field}: constrained output is not supported with PD disaggregation yet")
    if params.wants_logprobs:
        raise ValueError("logprobs: not supported with PD disaggregation yet")
    if len(generated):
        raise ValueError("generated_token_ids: resuming a stream is not supported with PD disaggregation yet")
