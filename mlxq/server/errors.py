"""One error type for the HTTP edge, rendered by one handler in the shape of the route's protocol.

Anthropic's routes (/v1/messages...) answer ``{"type": "error", "error": {type, message}}``;
every other route answers OpenAI's ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse


class APIError(Exception):
    """A request the server refuses; becomes ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param=None, code=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": _anthropic_type(self.status), "message": self.message}}

    def body_for(self, path: str) -> dict:
        return self.anthropic_body() if is_anthropic_path(path) else self.body()


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def _anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "request_too_large"
    if status == 503:
        return "service_unavailable"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_response(err: APIError, path: str = "") -> JSONResponse:
    return JSONResponse(err.body_for(path), status_code=err.status)


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc, request.url.path)


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return error_response(APIError(exc.status_code, exc.detail or "error"), request.url.path)


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"), request.url.path)
