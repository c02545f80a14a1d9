"""Structured output fields → one GrammarSpec, checked before the request starts (a bad grammar
is a 400 naming the field, even for a stream).

    response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name": ..., "schema": ...}}
                     (json_schema without a schema: any JSON object, as json_object)
    regex: "..." | ebnf: "..."             (extra fields, as other servers name them)
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ketch.sampling.grammar.spec import GrammarSpec
from ketch.server.errors import APIError

GRAMMAR_FIELDS = ("response_format", "regex", "ebnf")
# Building a grammar to check it can take seconds of CPU (a large schema); on the event loop that
# would stall every other request, stream and /health probe of this API process. Checks run on
# these threads instead, and one that takes longer than this is refused (its thread runs on to the
# end, off the loop: two at most, so a flood of slow ones costs two cores' worth, not the loop).
GRAMMAR_CHECK_S = 10.0
_checks = ThreadPoolExecutor(2, thread_name_prefix="ketch-grammar-check")
T = TypeVar("T")


def _response_format(rf: dict[str, Any]) -> GrammarSpec | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError(400, "response_format.json_schema: expected {'name': ..., 'schema': {...}}",
                           param="response_format")
        _check_json_schema_fields(js)
        if js.get("schema") is None:  # optional in OpenAI's API: then any JSON object, as json_object
            return GrammarSpec("json_object")
        try:
            return GrammarSpec.json_schema(js["schema"])
        except ValueError as e:
            raise APIError(400, f"response_format.{e}", param="response_format") from None
    raise APIError(400, f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format")


_JSON_SCHEMA_FIELDS = {"name": (str, "a string"), "description": (str, "a string"), "schema": (object, "a schema"),
                       "strict": (bool, "a boolean")}


def _check_json_schema_fields(js: dict[str, Any]) -> None:
    """OpenAI's json_schema object: a misspelt key (`shcema`) left the output unconstrained, silently."""
    for key, value in js.items():
        kind, named = _JSON_SCHEMA_FIELDS.get(key, (None, ""))
        if kind is None:
            raise APIError(400, f"response_format.json_schema.{key}: not a field of json_schema (known: "
                           f"{', '.join(_JSON_SCHEMA_FIELDS)})", param="response_format", code="unsupported_field")
        if value is not None and not isinstance(value, kind):
            raise APIError(400, f"response_format.json_schema.{key}: expected {named}",
                           param="response_format", code="invalid_type")


def grammar_spec(fields: dict[str, Any]) -> tuple[GrammarSpec | None, str | None]:
    """The request's grammar and the field it came from; 400 when several are given or one is invalid."""
    given = [f for f in GRAMMAR_FIELDS if fields.get(f) is not None]
    if len(given) > 1:
        raise APIError(400, f"{given[1]}: only one of {', '.join(GRAMMAR_FIELDS)} may be given", param=given[1])
    if not given:
        return None, None
    field = given[0]
    if field == "response_format":
        spec = _response_format(fields[field])
    else:
        try:
            spec = GrammarSpec(field, fields[field])
        except ValueError as e:
            raise APIError(400, str(e), param=field) from None
    if spec is not None:
        check_grammar(spec, field)
    return spec, field


def check_grammar(spec: GrammarSpec, field: str) -> None:
    from ketch.sampling.grammar.xgrammar_backend import XGrammarBackend  # xgrammar loads on first use

    try:
        XGrammarBackend.check(spec)
    except ValueError as e:
        message = str(e) if str(e).startswith(field) else f"{field}: {e}"
        raise APIError(400, message, param=field, code="invalid_grammar") from None


async def off_the_loop(fields: dict[str, Any], prepare: Callable[[], T]) -> T:
    """prepare() (which builds and checks the request's grammars: structured output, tools) on a
    check thread when the request has any of them, else here; a 400 past GRAMMAR_CHECK_S."""
    if not fields.get("tools") and all(fields.get(f) is None for f in GRAMMAR_FIELDS):
        return prepare()
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(_checks, prepare), GRAMMAR_CHECK_S)
    except TimeoutError:
        field = next((f for f in GRAMMAR_FIELDS if fields.get(f) is not None), "tools")
        raise APIError(400, f"{field}: building its grammar took over {GRAMMAR_CHECK_S:g} s; make it simpler",
                       param=field, code="invalid_grammar") from None
