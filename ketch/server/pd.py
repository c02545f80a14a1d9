"""The PD fields of a request body (issue 17; SGLang's names): `bootstrap_host` (str),
`bootstrap_port` (int) and `bootstrap_room` (int, 0 <= room < 2^63).

A PD gateway sends the same body, plus these, to a prefill server and a decode server at once;
the decode server's answer is the client's. Required on both kinds of server, refused (400 naming
the field) on a colocated one: there they would silently mean nothing. The checks are the
engine's own (engine/validation.py `validate_bootstrap`), made here so that a stream still gets
a 400 before it starts.
"""
from __future__ import annotations

from typing import Any

from ketch.engine.messages import Bootstrap
from ketch.engine.validation import validate_bootstrap
from ketch.sampling.params import SamplingParams
from ketch.server.errors import APIError, bad_value

BOOTSTRAP_FIELDS: dict[str, tuple[type, ...]] = {"bootstrap_host": (str,), "bootstrap_port": (int,),
                                                 "bootstrap_room": (int,)}
TRANSFER_FAILED = "bootstrap_room: KV transfer failed"  # how the engine words a failed transfer


def bootstrap_of(fields: dict[str, Any], mode: str, params: SamplingParams, num_prompts: int = 1,
                 generated: list[int] | None = None) -> Bootstrap | None:
    """The request's Bootstrap (None on a colocated server); a 400 naming the field otherwise."""
    host, port, room = (fields.get(name) for name in BOOTSTRAP_FIELDS)
    try:
        validate_bootstrap(mode, host, port, room, params, generated or ())
    except ValueError as e:
        message = str(e)
        raise bad_value(f"resume.{message}" if message.startswith("generated_token_ids") else message) from None
    if mode == "null":
        return None
    if num_prompts != 1:
        raise APIError(400, f"prompt: a PD request has one prompt, got {num_prompts}", param="prompt")
    return Bootstrap(host, port, room)


def transfer_failed(message: str) -> APIError:
    """The prefill server's KV never reached this decode server (or the other way round): the
    request could not be served here, through no fault of its body."""
    return APIError(503, message, param="bootstrap_room", type="service_unavailable", code="kv_transfer_failed")
