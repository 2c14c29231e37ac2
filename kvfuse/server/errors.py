"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the status and headers."""
from __future__ import annotations

import math

from fastapi.responses import JSONResponse

__all__ = ["APIError", "error_body", "error_response"]

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered to the client. `retry_after_s` adds a Retry-After header (429, 503)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        h = {}
        if self.retry_after_s is not None:
            h["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.status == 401:
            h["WWW-Authenticate"] = "Bearer"
        return h


def error_body(err: APIError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers())
