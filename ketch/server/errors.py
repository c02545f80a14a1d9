"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""
from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*)")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers  # e.g. a 429's Retry-After

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_value(e: ValueError | str) -> APIError:
    """A ValueError from SamplingParams / the engine / ketch.text: its message starts with the field."""
    message = str(e)
    match = _FIELD.match(message)
    return APIError(400, message, param=match.group(1) if match else None, code="invalid_value")


def engine_unavailable(message: str = "the engine is not running") -> APIError:
    return APIError(503, message, type="service_unavailable", code="engine_unavailable")


def server_shutdown() -> APIError:
    return APIError(503, "the server is shutting down; the request was cut at the shutdown deadline",
                    type="service_unavailable", code="server_shutdown")
