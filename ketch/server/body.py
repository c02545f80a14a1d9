"""Request bodies: read with a size and time limit, parsed as JSON with limits a fuzzer cannot pass.

Python's json accepts things no route can use and some that break it later: `NaN` and `Infinity`
literals, `1e999` (inf), integers of thousands of digits (a ValueError from int()), nesting deep
enough for a RecursionError, and `"\\ud800"` escapes that make strings no encoder takes. Each is a
400 here, naming where in the body it was, before any route looks at the body.
"""
from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from starlette.requests import ClientDisconnect, Request

from ketch.server.errors import APIError

MAX_JSON_DEPTH = 64  # messages → content parts, tool schemas: a few levels; JSON schemas: tens
INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # what a field can use (int64 / uint64)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The raw body; 413 beyond `limit` bytes (announced or not), 408 if it takes over `timeout` s."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:  # an answer for nobody, but an ordinary one: not logged as a server error
        raise APIError(400, "the client left before its request body was complete",
                       code="client_disconnected") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> Any:
    """The parsed body, checked by `check_json`; a 400 with code invalid_json otherwise."""
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise _invalid(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, NaN/Infinity, a huge int literal
        raise _invalid(str(e)) from None
    check_json(value)
    return value


def check_json(value: Any) -> None:
    """Depth, integer range, finite floats and encodable strings everywhere in `value`.

    Iterative, and it builds a path only for containers, so a long list of token ids costs one
    type check per id."""
    if not isinstance(value, (dict, list)):
        _check_leaf(value, "body")
        return
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _invalid(f"nested deeper than {MAX_JSON_DEPTH} levels", path)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, item in items:
            if isinstance(key, str):
                _check_str(key, path or "body")
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1, _join(path, key)))
            elif type(item) is not bool and item is not None:
                _check_leaf(item, path, key)


def _check_leaf(item: Any, path: str, key: Any = None) -> None:
    t = type(item)
    if t is str:
        _check_str(item, _join(path, key))
    elif t is int:
        if not INT_MIN <= item <= INT_MAX:
            raise _invalid(f"an integer does not fit in 64 bits ({item.bit_length()} bits)", _join(path, key))
    elif t is float and not math.isfinite(item):
        raise _invalid("numbers must be finite", _join(path, key))


def _check_str(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{where}: contains a lone surrogate (not valid Unicode text)",
                       param=where.split(".")[0].split("[")[0], code="invalid_value") from None


def _join(path: str, key: Any) -> str:
    if key is None:
        return path
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _invalid(why: str, path: str = "") -> APIError:
    if not path:
        return APIError(400, f"the request body is not valid JSON: {why}", code="invalid_json")
    return APIError(400, f"{path}: {why}", param=path.split(".")[0].split("[")[0] or None, code="invalid_value")
