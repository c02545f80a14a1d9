"""The gateway's HTTP routes: the OpenAI API relayed to workers, its own health and metrics, and
the worker admin routes.

    POST /v1/chat/completions, /v1/completions   routed by the policy, relayed (stream or not)
    GET  /v1/models, /v1/models/{model}          relayed from the least loaded worker
    GET  /health (or HEAD)                       200 while a worker is available, else 503 (no key)
    GET  /metrics                                the gateway's own Prometheus metrics
    GET  /workers                                every worker's state
    POST /workers {"url": ..., "api_key"?: ...}  add one (it must answer /health first); PD mode:
                  + "role": "prefill"|"decode", "bootstrap_port"? (prefill, default 8998)
    DELETE /workers/{url}                        remove one (the URL percent-encoded)
"""
from __future__ import annotations

import contextlib
import hmac
from typing import Any, AsyncIterator
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from ketch.gateway.body import ClientGone, parse_object, read_body
from ketch.gateway.config import DEFAULT_BOOTSTRAP_PORT
from ketch.gateway.errors import GatewayError, unavailable
from ketch.gateway.gateway import Gateway
from ketch.gateway.generate import GENERATION_ROUTES, Generation
from ketch.gateway.monitor import probe_health
from ketch.gateway.registry import DuplicateWorker
from ketch.gateway.worker_url import WorkerAddress, parse_worker_url
from ketch.request_id import SCOPE_KEY as REQUEST_ID_KEY
from ketch.request_id import SendWithId, request_id

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without a key


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    try:
        return parse_object(await read_body(request.receive, limit))
    except ClientGone:
        raise GatewayError(400, "the client left before its request body was complete", "invalid_json") from None


class FrontDoor:
    """The outermost ASGI layer: the request id (ketch/request_id.py: on every answer, passed on to
    the workers), the gateway's own API key on every route but /health, then the generation
    routes straight to their plain ASGI handler (generate.py), the rest to FastAPI."""

    def __init__(self, app: Any, key: str | None, generation: Generation) -> None:
        self.app, self.key, self.generation = app, key, generation

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":  # every answer names its request (the client's x-request-id, or a new one)
            scope[REQUEST_ID_KEY] = rid = request_id(scope["headers"])
            send = SendWithId(send, rid)
        if scope["type"] == "http" and self.key is not None and scope["path"] not in OPEN_PATHS:
            authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            try:
                check_key(authorization, self.key)
            except GatewayError as e:
                await e.response()(scope, receive, send)
                return
        route = GENERATION_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if route is not None:
            if scope["method"] == "POST":
                await self.generation(scope, receive, send, route)
            else:
                error = GatewayError(405, f"{scope['path']} takes POST only", "method_not_allowed")
                await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def check_key(authorization: str, key: str) -> None:
    scheme, _, token = authorization.partition(" ")
    # bytes: compare_digest refuses non-ASCII str, and a header may carry any latin-1 byte
    given = token.strip().encode("latin-1", "replace")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, key.encode("utf-8")):
        raise GatewayError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", "invalid_api_key",
                           type="authentication_error")


def build_app(gw: Gateway) -> FrontDoor:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(title="ketch gateway", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, e: GatewayError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request")
        return GatewayError(e.status_code, str(e.detail), code).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return GatewayError(400, str(e), "invalid_value").response()

    @app.get("/v1/models")
    async def models() -> Response:
        return await gw.forwarder.plain("GET", "/v1/models", "/v1/models")

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        return await gw.forwarder.plain("GET", f"/v1/models/{quote(model, safe='')}", "/v1/models/{model}")

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either, as a worker's
    async def health() -> Response:
        # a request needs one worker of each role (PD mode: a prefill and a decode worker)
        available = {role: len(gw.registry.available(role=role)) for role in gw.config.roles}
        missing = [role for role, n in available.items() if not n]
        if missing:
            kind = "".join(f"{role} " for role in missing if role != "normal")
            states = gw.registry.states(missing) or "none is registered"
            return unavailable(f"no {kind}worker is available: {states}").response()
        body: dict[str, Any] = {"status": "ok", "workers_available": sum(available.values()),
                                "workers": len(gw.registry.all())}
        if gw.config.pd_disaggregation:
            body.update(prefill_available=available["prefill"], decode_available=available["decode"])
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gw.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/workers")
    async def list_workers() -> dict[str, Any]:
        now = gw.clock()
        return {"policy": gw.policy.name, "workers": [w.describe(now) for w in gw.registry.all()]}

    @app.post("/workers", status_code=201)
    async def add_worker(request: Request) -> JSONResponse:
        parsed = await read_json_object(request, 64 * 1024)
        address = _address(parsed, gw.config.pd_disaggregation)
        role, bootstrap_port = _role(parsed) if gw.config.pd_disaggregation else ("normal", None)
        if gw.registry.get(address.url) is not None:
            raise GatewayError(409, f"worker {address.url} is already registered", "worker_exists", param="url")
        key = address.api_key or gw.config.worker_api_key
        headers = {"authorization": f"Bearer {key}"} if key else {}
        probe = await probe_health(gw.client, address.url, headers, gw.config.health.check_timeout_secs)
        if probe.problem is not None:
            raise GatewayError(400, f"worker {address.url} did not pass its health check: {probe.problem}",
                               "worker_unreachable", param="url")
        try:  # checked again (and by instance: the same server under another address), after the probe
            worker = gw.registry.add(address, role, bootstrap_port, probe.instance)
        except DuplicateWorker as e:
            raise GatewayError(409, str(e), "worker_exists", param="url") from None
        return JSONResponse(worker.describe(gw.clock()), status_code=201)

    @app.delete("/workers/{url:path}")
    async def remove_worker(url: str) -> dict[str, Any]:
        try:
            canonical = parse_worker_url(url).url
            gw.registry.remove(canonical)
        except (ValueError, KeyError):
            raise GatewayError(404, f"no worker {url!r} is registered (GET /workers lists them)", "worker_not_found",
                               param="url") from None
        return {"url": canonical, "removed": True}

    generation = Generation(lambda: gw.responder, gw.config.max_request_bytes,
                            resumable=not gw.config.pd_disaggregation)
    return FrontDoor(app, gw.config.api_key, generation)


def _address(parsed: dict[str, Any], pd: bool) -> WorkerAddress:
    known = {"url", "api_key", "role", "bootstrap_port"} if pd else {"url", "api_key"}
    unknown = sorted(set(parsed) - known)
    if unknown:
        expected = "'url', 'role' and optionally 'api_key', 'bootstrap_port'" if pd else "'url' and optionally 'api_key'"
        raise GatewayError(400, f"{unknown[0]}: unknown field (expected {expected})", "invalid_value", param=unknown[0])
    key = parsed.get("api_key")
    if key is not None and (not isinstance(key, str) or not key):
        raise GatewayError(400, "api_key: must be a non-empty string", "invalid_value", param="api_key")
    try:
        address = parse_worker_url(parsed.get("url"))
    except ValueError as e:
        raise GatewayError(400, str(e), "invalid_value", param="url") from None
    return WorkerAddress(address.url, key or address.api_key)


def _role(parsed: dict[str, Any]) -> tuple[str, int | None]:
    """PD mode: a joining worker's role, and a prefill worker's bootstrap port."""
    role, port = parsed.get("role"), parsed.get("bootstrap_port", DEFAULT_BOOTSTRAP_PORT)
    if role not in ("prefill", "decode"):
        raise GatewayError(400, f"role: must be 'prefill' or 'decode' in PD mode, got {role!r}", "invalid_value",
                           param="role")
    if role == "decode":
        if "bootstrap_port" in parsed:
            raise GatewayError(400, "bootstrap_port: only a prefill worker has one", "invalid_value",
                               param="bootstrap_port")
        return role, None
    if type(port) is not int or not 0 < port < 65536:
        raise GatewayError(400, f"bootstrap_port: must be an integer in [1, 65535], got {port!r}", "invalid_value",
                           param="bootstrap_port")
    return role, port
