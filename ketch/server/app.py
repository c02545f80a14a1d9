"""The FastAPI app: routes, and every error as an OpenAI error body."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ketch.server.body import parse_json
from ketch.server.body import read_body as read_raw_body
from ketch.server.chat import chat_completions, encode_messages
from ketch.server.completions import completions
from ketch.server.encoding import on_encoder_thread
from ketch.server.errors import APIError, engine_unavailable
from ketch.server.front_door import REQUEST_ID_KEY, internal_error
from ketch.server.openapi import openapi_schema
from ketch.server.protocol import DETOKENIZE_FIELDS, TOKENIZE_FIELDS, check_fields
from ketch.server.state import ServerState
from ketch.server.structured import off_the_loop
from ketch.server.tools import plan_chat

_STATS_TIMEOUT_S = 10.0
# the engine reads a flush between steps: on a busy CPU engine one long prefill step can take a while
_FLUSH_TIMEOUT_S = 60.0
log = logging.getLogger("ketch.server")


def build_app(state: ServerState, max_request_bytes: int, body_timeout: float = 60.0) -> FastAPI:
    """The routes; wrap the result in FrontDoor (request ids, API key) before serving it."""
    app = FastAPI(title="ketch", docs_url=None, redoc_url=None, openapi_url=None)

    async def read_body(request: Request) -> Any:
        return parse_json(await read_raw_body(request, max_request_bytes, body_timeout))

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        response = APIError(e.status_code, str(e.detail), type="invalid_request_error").response()
        response.headers.update(e.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, str(e)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        request_id = request.scope.get(REQUEST_ID_KEY)
        log.error("unexpected error in %s %s (request id %s)", request.method, request.url.path, request_id,
                  exc_info=e)
        return internal_error(request_id).response()

    def _require_engine() -> None:
        if state.shutting_down:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="server_shutdown")
        if not state.client.alive:
            raise engine_unavailable(state.client.failure or "the engine is not running")

    schema = openapi_schema(state.model_name, state.max_n, state.client.ready.vocab_size if state.client.ready else 1)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict:
        return schema

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
    async def health() -> Response:
        problem = state.client.healthy()  # the watchdog's verdict: no round trip through the step loop
        return Response(status_code=200) if problem is None else engine_unavailable(problem).response()

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await state.client.stats(_STATS_TIMEOUT_S)
        return Response(state.metrics.render(stats, state.client), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        """Empty the prefix cache (device and host tiers) of every page no running request holds,
        so a benchmark can start cold; SGLang's name. Running requests are not affected."""
        _require_engine()
        done = await state.client.flush_cache(_FLUSH_TIMEOUT_S)
        if done is None:
            if not state.client.alive:
                raise engine_unavailable(state.client.failure or "the engine is not running")
            raise APIError(503, f"the engine did not answer the flush within {_FLUSH_TIMEOUT_S:g} s",
                           type="service_unavailable", code="engine_busy")
        return {"object": "flush_cache", "freed_pages": done.device_pages, "freed_host_pages": done.host_pages}

    def model_card() -> dict:
        ready = state.client.ready
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "ketch",
                "max_model_len": ready.max_model_len if ready else None}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        """One model's card (the SDKs' models.retrieve); another name is a 404 naming it."""
        state.check_model(model)
        return model_card()

    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Response:
        _require_engine()
        return await completions(state, await read_body(request), request)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request) -> Response:
        _require_engine()
        return await chat_completions(state, await read_body(request), request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = check_fields(await read_body(request), TOKENIZE_FIELDS)
        state.check_model(body.get("model"))
        tok = state.require_tokenizer("prompt")
        if "prompt" in body and "messages" in body:
            raise APIError(400, "prompt: send either prompt or messages, not both", param="prompt")
        if "prompt" in body:
            text, special = body["prompt"], body.get("add_special_tokens", True)
            ids = await on_encoder_thread(lambda: tok.encode(text, add_special_tokens=special))
        elif "messages" in body:
            plan = await off_the_loop(body, lambda: plan_chat(  # tool history and tools as the chat route has them
                body, state.chat_template.source if state.chat_template else None, state.tool_call_parser,
                state.reasoning_parser))
            ids = await on_encoder_thread(lambda: encode_messages(state, plan.messages, plan.template_kwargs))
        else:
            raise APIError(400, "prompt: send {'prompt': str} or {'messages': [...]}", param="prompt")
        ready = state.client.ready
        return {"tokens": ids, "count": len(ids), "max_model_len": ready.max_model_len if ready else None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = check_fields(await read_body(request), DETOKENIZE_FIELDS)
        state.check_model(body.get("model"))
        tok = state.require_tokenizer("tokens")
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "tokens: must be a list of token ids", param="tokens")
        if ids and (min(ids) < 0 or max(ids) >= tok.vocab_size):
            raise APIError(400, f"tokens: token ids must be in [0, {tok.vocab_size})", param="tokens")
        # a 32 MB body holds millions of ids: decoded on an encoding thread, not the event loop
        return {"prompt": await on_encoder_thread(lambda: tok.decode(ids, skip_special_tokens=False))}

    return app
