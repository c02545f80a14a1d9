"""The gateway's own errors, shaped like the workers' (OpenAI: `{"error": {"message", "type",
"param", "code"}}`), so a client cannot tell which of the two answered except by the code.
Errors a worker gives are never rewritten: they pass through with their status and body."""
from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class GatewayError(Exception):
    def __init__(self, status: int, message: str, code: str, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, type, param
        self.headers = headers  # e.g. a 429's Retry-After

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unavailable(message: str, code: str = "no_available_workers") -> GatewayError:
    return GatewayError(503, message, code, type="service_unavailable")


def all_busy(message: str, retry_after: str) -> GatewayError:
    """Every worker tried answered 429 (its queue full): the client should come back, not give up."""
    return GatewayError(429, message, "queue_full", type="rate_limit_error", headers={"Retry-After": retry_after})
