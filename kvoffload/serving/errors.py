"""OpenAI's error JSON, and the handlers that turn every failure into it.

Every error answer is ``{"error": {"message", "type", "param", "code"}}``. Bad input (malformed
JSON, a field of the wrong type or range, an unknown model, a prompt too long) is status 400
with ``param`` naming the field (dotted for nested ones, e.g. ``messages.0.role``); an unknown
path is 404; anything unexpected is 500 with a one-line message, never a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvoffload.errors import ConfigError, KVOffloadError

__all__ = ["APIError", "error_body", "install_error_handlers"]

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


_BRANCH_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "constrained-int"})


class APIError(KVOffloadError):
    """An error answered with ``status``; ``param`` names the request field at fault."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code

    @classmethod
    def from_config_error(cls, exc: ConfigError, param: str | None = None) -> APIError:
        return cls(exc.message, param or exc.field)


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object for ``status``."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def _response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # A union's branch names (e.g. "str", "list[int]") are pydantic's, not the request's.
    parts = [p for p in parts if "[" not in p and p not in _BRANCH_NAMES]
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}", None
    params = [_validation_param(tuple(e.get("loc", ()))) or "" for e in errors]
    # A union's branches each report an error: name the deepest place under the first field.
    top = params[0].split(".")[0] if params else ""
    param = max((p for p in params if p.split(".")[0] == top), key=len, default="") or None
    detail = "; ".join(
        f"{_validation_param(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg')}"
        for e in errors[:5]
    )
    count = len(errors)
    return f"{count} validation error{'s' if count != 1 else ''}: {detail}", param


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure of ``app`` with OpenAI's error JSON."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _response(400, message, param)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return _response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(ConfigError)
    async def _config(_: Request, exc: ConfigError) -> JSONResponse:
        return _response(400, exc.message, exc.field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _response(404, f"{request.url.path} is not an endpoint of this server")
        return _response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed: %r", request.method, request.url.path, exc)
        return _response(500, f"internal error: {type(exc).__name__}")
