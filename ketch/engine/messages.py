"""Typed messages between the API process and the engine process (msgspec + msgpack, never pickle).

    API ──(GenerateRequest | AbortRequest | Ping | FlushCache | Shutdown)──▶ engine
    API ◀──(EngineReady | EngineError | TokenOutputs | RequestError | Pong | CacheFlushed | Heartbeat)── engine

Each message is a tagged msgspec Struct, so one Union decodes any of them and the tag says which.
SamplingParams is a dataclass whose __post_init__ normalises and validates; it travels as a
WireSamplingParams (its fields, typed: the decoder checks the types) and is rebuilt (and so its
values re-validated) on the engine side.
"""
from __future__ import annotations

import dataclasses
import re

import msgspec

from ketch.engine.outputs import EngineOutput, EngineStats
from ketch.sampling.grammar.spec import GrammarSpec
from ketch.sampling.params import SamplingParams


# ---------------------------------------------------------------- API → engine
class WireGrammar(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: str
    source: str


class WireSamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """SamplingParams' fields with the types they have after its __post_init__ (stop and
    stop_token_ids are lists, the grammar a plain struct). The field list is SamplingParams':
    tests/test_messages.py fails when the two differ. No defaults: a sender sends every field.

    A struct only checks types; the values are checked by SamplingParams, rebuilt by `to_params`
    inside the engine's error handling, so a bad value answers its request, not the process."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int | None
    logit_bias: dict[int, float] | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    max_tokens: int
    min_tokens: int
    logprobs: bool
    top_logprobs: int
    skip_special_tokens: bool
    grammar: WireGrammar | None

    @classmethod
    def from_params(cls, params: SamplingParams) -> "WireSamplingParams":
        # iterate the dataclass's fields, not ours: a field the wire lacks is a TypeError at once
        values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
        grammar = params.grammar
        values["grammar"] = None if grammar is None else WireGrammar(grammar.kind, grammar.source)
        return cls(**values)

    def to_params(self) -> SamplingParams:
        """The SamplingParams again; raises ValueError naming the field for a value it refuses."""
        values = msgspec.structs.asdict(self)
        grammar = self.grammar
        values["grammar"] = None if grammar is None else GrammarSpec(grammar.kind, grammar.source)
        return SamplingParams(**values)


class Bootstrap(msgspec.Struct, frozen=True):
    """PD disaggregation: where a request's prefill side is, and the room that pairs its two halves
    (the request body's bootstrap_host, bootstrap_port, bootstrap_room: SGLang's names)."""

    host: str
    port: int
    room: int

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


class GenerateRequest(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    prompt_ids: list[int]
    params: WireSamplingParams
    origin: int = 0  # the API process that sent it (--api-server-count): its outputs go back there
    generated_token_ids: list[int] = []  # a resumed stream's outputs so far (engine README)
    bootstrap: Bootstrap | None = None  # PD: its room and the prefill server's bootstrap address


class AbortRequest(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    index: int | None = None  # one of the n samples, or all of them (one message for the request)


class Ping(msgspec.Struct, tag=True, frozen=True):
    nonce: int
    origin: int = 0  # the API process that asks: the Pong goes back there


class FlushCache(msgspec.Struct, tag=True, frozen=True):
    """POST /flush_cache: empty the prefix cache of every page no running request holds."""

    nonce: int
    origin: int = 0  # the API process that asks: the CacheFlushed goes back there


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


# ---------------------------------------------------------------- engine → API
class EngineReady(msgspec.Struct, tag=True, frozen=True):
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # prompt + max_tokens may not exceed this either
    instance_id: str  # drawn at the engine's start: the server's x-ketch-instance (ketch/instance_id.py)


class EngineError(msgspec.Struct, tag=True, frozen=True):
    message: str  # the engine failed as a whole (startup or step); it exits after sending this
    # its build refused a setting (a ValueError naming it, before EngineReady): the command line is
    # wrong, not the engine (`ketch serve` says so in one line, exit 2, as `ketch generate` does)
    setting: bool = False


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
    pd_timing: tuple[float, float, float, float] | None = None  # EngineOutput.pd_timing

    @classmethod
    def from_output(cls, o: EngineOutput) -> "TokenDelta":
        logprobs = None if o.new_logprobs is None else [
            WireLogprob(lp.token_id, lp.logprob, [tuple(t) for t in lp.top]) for lp in o.new_logprobs
        ]
        return cls(o.request_id, o.index, o.new_token_ids, logprobs, o.finished, o.finish_reason,
                   o.matched_stop, o.num_prompt_tokens, o.num_cached_tokens, o.error, o.pd_timing)


class TokenOutputs(msgspec.Struct, tag=True, frozen=True):
    outputs: list[TokenDelta]


class RequestError(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    message: str  # a ValueError's text: starts with the field name


class Pong(msgspec.Struct, tag=True, frozen=True):
    nonce: int
    stats: EngineStats  # a ping doubles as the stats query behind /metrics


class CacheFlushed(msgspec.Struct, tag=True, frozen=True):
    nonce: int
    device_pages: int  # pages the flush freed on the device
    host_pages: int  # ... and on the host tier (0 without one)


class Heartbeat(msgspec.Struct, tag=True, frozen=True):
    """Sent by the engine process's own thread every HEARTBEAT_S: the process is alive, and
    `steps` tells the API's watchdog whether a busy step loop still makes progress."""

    steps: int
    busy: bool


HEARTBEAT_S = 0.5

ToEngine = GenerateRequest | AbortRequest | Ping | FlushCache | Shutdown
FromEngine = EngineReady | EngineError | TokenOutputs | RequestError | Pong | CacheFlushed | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(data: bytes) -> ToEngine:
    """Raises msgspec.ValidationError for a field of the wrong type (see `undecodable_request`)."""
    return _to_engine.decode(data)


_ERROR_PATH = re.compile(r"^(?P<what>.*) - at (?:`key` in )?`\$\.(?:params\.)?(?P<field>[A-Za-z_]+)[^`]*`$")


def undecodable_request(data: bytes, error: msgspec.ValidationError) -> RequestError | None:
    """The RequestError that answers a GenerateRequest whose fields failed the typed decode, so a
    sender's bad value ends its own request and not the engine; None when the message does not
    name a request (then it is a protocol error, and the caller treats it as fatal)."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(raw, dict) or raw.get("type") != "GenerateRequest":
        return None
    request_id = raw.get("request_id")
    if not isinstance(request_id, str):
        return None
    # msgspec says "Expected `int`, got `str` - at `$.params.top_k`"; our messages start with the field
    text = str(error)
    match = _ERROR_PATH.match(text)
    if match is not None:
        what = match.group("what")
        text = f"{match.group('field')}: {what[:1].lower()}{what[1:]}"
    return RequestError(request_id, text)


def origin_of(data: bytes) -> int:
    """The sending API process of a message the typed decode refused (0 when it does not say)."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return 0
    origin = raw.get("origin", 0) if isinstance(raw, dict) else 0
    return origin if isinstance(origin, int) and not isinstance(origin, bool) else 0


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)
