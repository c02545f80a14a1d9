"""The FastAPI app: routes, and every error as an OpenAI error body."""
from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ketch.server.chat import chat_completions, encode_messages
from ketch.server.completions import completions
from ketch.server.errors import APIError, engine_unavailable
from ketch.server.state import ServerState

_HEALTH_TIMEOUT_S = 10.0


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


async def _json_body(request: Request, limit: int) -> Any:
    """The parsed body; 413 beyond `limit` bytes, whether announced by Content-Length or not."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def build_app(state: ServerState, max_request_bytes: int) -> FastAPI:
    app = FastAPI(title="ketch", docs_url=None, redoc_url=None, openapi_url=None)

    async def read_body(request: Request) -> Any:
        return await _json_body(request, max_request_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        return APIError(e.status_code, str(e.detail), type="invalid_request_error").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, str(e)).response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):  # every route but /health
        if request.url.path != "/health":
            try:
                state.check_api_key(request.headers.get("authorization"))
            except APIError as e:
                return e.response()
        return await call_next(request)

    def _require_engine() -> None:
        if not state.client.alive:
            raise engine_unavailable()

    @app.get("/health")
    async def health() -> Response:
        if await state.client.ping(_HEALTH_TIMEOUT_S):
            return Response(status_code=200)
        return engine_unavailable().response()

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await state.client.stats(_HEALTH_TIMEOUT_S)
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        ready = state.client.ready
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "ketch",
            "max_model_len": ready.max_model_len if ready else None,
        }]}

    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Response:
        _require_engine()
        return await completions(state, await read_body(request))

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request) -> Response:
        _require_engine()
        return await chat_completions(state, await read_body(request))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await read_body(request)
        tok = state.require_tokenizer("prompt")
        if isinstance(body, dict) and isinstance(body.get("prompt"), str):
            ids = tok.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
        elif isinstance(body, dict) and "messages" in body:
            ids = encode_messages(state, body["messages"])
        else:
            raise APIError(400, "prompt: send {'prompt': str} or {'messages': [...]}", param="prompt")
        ready = state.client.ready
        return {"tokens": ids, "count": len(ids), "max_model_len": ready.max_model_len if ready else None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await read_body(request)
        tok = state.require_tokenizer("tokens")
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "tokens: must be a list of token ids", param="tokens")
        if ids and (min(ids) < 0 or max(ids) >= tok.vocab_size):
            raise APIError(400, f"tokens: token ids must be in [0, {tok.vocab_size})", param="tokens")
        return {"prompt": tok.decode(ids, skip_special_tokens=False)}

    return app
