"""Typed messages between the API process and the engine process (msgspec + msgpack, never pickle).

    API ──(GenerateRequest | AbortRequest | Ping | Shutdown)──▶ engine
    API ◀──(EngineReady | EngineError | TokenOutputs | RequestError | Pong | Heartbeat)── engine

Each message is a tagged msgspec Struct, so one Union decodes any of them and the tag says which.
SamplingParams is a dataclass whose __post_init__ normalises and validates; it travels as a map
of its fields and is rebuilt (and so re-validated) on the engine side.
"""
from __future__ import annotations

from typing import Any

import msgspec

from ketch.engine.outputs import EngineOutput, EngineStats


# ---------------------------------------------------------------- API → engine
class GenerateRequest(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    prompt_ids: list[int]
    # the SamplingParams dataclass goes out as a map of its fields; the engine rebuilds it inside
    # its error handling, so a value that fails validation answers that request, not the process
    params: dict[str, Any]


class AbortRequest(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    index: int | None = None  # one of the n samples, or all of them (one message for the request)


class Ping(msgspec.Struct, tag=True, frozen=True):
    nonce: int


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


# ---------------------------------------------------------------- engine → API
class EngineReady(msgspec.Struct, tag=True, frozen=True):
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # prompt + max_tokens may not exceed this either


class EngineError(msgspec.Struct, tag=True, frozen=True):
    message: str  # the engine failed as a whole (startup or step); it exits after sending this


class WireLogprob(msgspec.Struct, array_like=True, frozen=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class TokenDelta(msgspec.Struct, array_like=True, frozen=True):
    """One sample's news from one step; the field names match EngineOutput's (SampleText reads them)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[WireLogprob] | None
    finished: bool
    finish_reason: str | None
    matched_stop: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None

    @classmethod
    def from_output(cls, o: EngineOutput) -> "TokenDelta":
        logprobs = None if o.new_logprobs is None else [
            WireLogprob(lp.token_id, lp.logprob, [tuple(t) for t in lp.top]) for lp in o.new_logprobs
        ]
        return cls(o.request_id, o.index, o.new_token_ids, logprobs, o.finished, o.finish_reason,
                   o.matched_stop, o.num_prompt_tokens, o.num_cached_tokens, o.error)


class TokenOutputs(msgspec.Struct, tag=True, frozen=True):
    outputs: list[TokenDelta]


class RequestError(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    message: str  # a ValueError's text: starts with the field name


class Pong(msgspec.Struct, tag=True, frozen=True):
    nonce: int
    stats: EngineStats  # a ping doubles as the stats query behind /metrics


class Heartbeat(msgspec.Struct, tag=True, frozen=True):
    """Sent by the engine process's own thread every HEARTBEAT_S: the process is alive, and
    `steps` tells the API's watchdog whether a busy step loop still makes progress."""

    steps: int
    busy: bool


HEARTBEAT_S = 0.5

ToEngine = GenerateRequest | AbortRequest | Ping | Shutdown
FromEngine = EngineReady | EngineError | TokenOutputs | RequestError | Pong | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)
