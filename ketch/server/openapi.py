"""GET /openapi.json: the schema of the routes, made from the same field tables that check bodies.

Bodies are checked by hand (protocol.py), not by pydantic models, so FastAPI cannot describe
them; this builds the description from those tables and from SamplingParams' limits, so the
schema a client or a fuzzer reads is the one the server enforces. Every route may answer with an
OpenAI error body; generation routes also stream (text/event-stream).
"""
from __future__ import annotations

from typing import Any

from ketch.sampling import params as sp
from ketch.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS, DETOKENIZE_FIELDS, MAX_TIMEOUT_S, TOKENIZE_FIELDS

_JSON_TYPE = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_INT64 = {"minimum": sp.INT64_MIN, "maximum": sp.INT64_MAX}
_RANGES: dict[str, dict[str, Any]] = {  # what SamplingParams accepts (the server re-checks everything)
    "temperature": {"minimum": 0, "maximum": sp.MAX_TEMPERATURE},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "maximum": sp.INT64_MAX},
    "min_p": {"minimum": 0, "maximum": 1},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": sp.MAX_REPETITION_PENALTY},
    "frequency_penalty": {"minimum": -sp.MAX_ABS_PENALTY, "maximum": sp.MAX_ABS_PENALTY},
    "presence_penalty": {"minimum": -sp.MAX_ABS_PENALTY, "maximum": sp.MAX_ABS_PENALTY},
    "seed": _INT64,
    "max_tokens": {"minimum": 1, "maximum": sp.INT64_MAX},
    "max_completion_tokens": {"minimum": 1, "maximum": sp.INT64_MAX},
    "min_tokens": {"minimum": 0, "maximum": sp.INT64_MAX},
    "top_logprobs": {"minimum": 0, "maximum": sp.MAX_TOP_LOGPROBS},
    "timeout": {"exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_S},
    # PD (server/pd.py): required on a prefill or decode server, refused on a colocated one
    "bootstrap_port": {"minimum": 1, "maximum": 65535},
    "bootstrap_room": {"minimum": 0, "maximum": sp.INT64_MAX},
}
_STRING_OR_LIST = {"stop": {"maxItems": sp.MAX_STOP_STRINGS,
                            "items": {"type": "string", "minLength": 1, "maxLength": sp.MAX_STOP_LENGTH}}}
_ERROR_STATUSES = ("400", "401", "404", "408", "413", "429", "500", "503")


def _field(name: str, types: tuple[type, ...], max_n: int, vocab_size: int) -> dict[str, Any]:
    names = sorted({_JSON_TYPE[t] for t in types})
    if "integer" in names and "number" in names:
        names.remove("integer")
    schema: dict[str, Any] = {"type": [*names, "null"]}  # null means "not given"
    schema.update(_RANGES.get(name, {}))
    if name == "n":
        schema.update(minimum=1, maximum=max_n)
    if name == "messages":
        schema.update(minItems=1, items={
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["system", "user", "assistant"]}, "content": {"type": "string"}}})
    if name == "prompt":
        schema.update(minLength=1, minItems=1)
    if name == "tokens":
        schema["items"] = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    if name == "resume":  # README, "Resuming a stream"
        schema.update(additionalProperties=False, required=["generated_token_ids"], properties={
            "generated_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                "maximum": vocab_size - 1}},
            "regenerate_last": {"type": "integer", "minimum": 0}})
    if name in _STRING_OR_LIST and "array" in names:
        schema.update(_STRING_OR_LIST[name])
    return schema


def _body(fields: dict[str, tuple[type, ...]], required: list[str], max_n: int, vocab_size: int) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "additionalProperties": False, "required": required,
        "properties": {name: _field(name, types, max_n, vocab_size) for name, types in fields.items()}}}}}


def _responses(ok: dict[str, Any], stream: bool) -> dict[str, Any]:
    content = {"application/json": {"schema": ok}}
    if stream:
        # each server-sent event: a `data:` line of JSON (a chunk or an error body) or [DONE]
        content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                                   "properties": {"data": {"type": "string"}}}}
    out: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for status in _ERROR_STATUSES:
        out[status] = {"description": "an OpenAI error body",
                       "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return out


def _object(*required: str) -> dict[str, Any]:
    return {"type": "object", "required": list(required)}


def openapi_schema(title: str, max_n: int, vocab_size: int) -> dict[str, Any]:
    def post(fields, required, ok, stream=False):
        return {"post": {"requestBody": _body(fields, required, max_n, vocab_size),
                         "responses": _responses(ok, stream)}}

    def get(ok):
        return {"get": {"responses": _responses(ok, False)}}

    generated = _object("id", "object", "created", "model", "choices", "usage")
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": {
            "/v1/chat/completions": post(CHAT_FIELDS, ["messages"], generated, stream=True),
            "/v1/completions": post(COMPLETION_FIELDS, ["prompt"], generated, stream=True),
            "/tokenize": post(TOKENIZE_FIELDS, [], _object("tokens", "count")),
            "/detokenize": post(DETOKENIZE_FIELDS, ["tokens"], _object("prompt")),
            "/v1/models": get(_object("object", "data")),
            "/v1/models/{model}": {"get": {
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": _responses(_object("id", "object", "created", "owned_by"), False)}},
        },
        "components": {"schemas": {"Error": {
            "type": "object", "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"],
                                     "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                                    "param": {"type": ["string", "null"]},
                                                    "code": {"type": ["string", "null"]}}}}}}},
    }
