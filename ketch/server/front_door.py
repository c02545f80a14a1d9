"""The outermost ASGI layer: a request id on every answer (the client's x-request-id when it
sends one: ketch/request_id.py), the API key, and no bare 500.

    uvicorn ──▶ FrontDoor ──▶ FastAPI (its exception handler turns an unexpected exception into
                               an OpenAI-style JSON 500 naming the request id, and logs it once)

Starlette answers through that handler and then raises the exception again so that a server can
log it; the handler has logged it already, so it ends here instead of in uvicorn's log a second
time. A pure ASGI layer (not `@app.middleware`) costs one function call per request and lets
streams and disconnect watching see the real `receive`.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from ketch.request_id import SCOPE_KEY as REQUEST_ID_KEY
from ketch.request_id import SendWithId, request_id
from ketch.server.errors import APIError
from ketch.server.state import ServerState

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})  # answered without the API key (load balancers probe it)


class FrontDoor:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], state: ServerState,
                 headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        """headers: added to every answer (with --api-server-count: which API process answered)."""
        self.app, self.state, self.headers = app, state, headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope["headers"])  # the client's x-request-id, or a new one
        scope[REQUEST_ID_KEY] = rid
        send_with_id = SendWithId(send, rid, self.headers)

        if scope["path"] not in OPEN_PATHS:
            try:
                self.state.check_api_key(_authorization(scope))
            except APIError as e:
                await e.response()(scope, receive, send_with_id)
                return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # answered (or the stream cut) and logged by the app's handler
            pass


def _authorization(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")  # HTTP header bytes; never fails
    return None


def internal_error(request_id: str | None) -> APIError:
    return APIError(500, f"internal server error (request id {request_id}); the server logged the details",
                    type="internal_error", code="internal_error")
