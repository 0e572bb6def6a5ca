"""OpenAI's error envelope, so every client library reads our refusals as it reads OpenAI's."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger(__name__)

INVALID = "invalid_request_error"
SERVER = "server_error"
UNAVAILABLE = "service_unavailable_error"
RETRY_AFTER_S = 1


class ApiError(Exception):
    """A refusal with the HTTP status and the envelope's fields; raised anywhere, rendered once."""

    def __init__(self, status: int, message: str, type: str = INVALID, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON envelope: {"error": {message, type, param, code}}."""
        return envelope(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        """The envelope as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def envelope(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 invalid_request_error naming the field at fault."""
    return ApiError(400, message, INVALID, param, code)


def model_not_found(name: str, served: tuple[str, ...]) -> ApiError:
    """A request or route naming a model this server does not serve (vLLM's 404)."""
    names = ", ".join(f"'{s}'" for s in served)
    return ApiError(404, f"The model '{name}' does not exist; this server serves {names}", param="model",
                    code="model_not_found")


def queue_full(message: str) -> ApiError:
    """A 503 telling the client to come back shortly."""
    return ApiError(503, f"the server is busy: {message}; retry later", UNAVAILABLE,
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def engine_failed(message: str) -> ApiError:
    """A 500 for a request the engine could not finish; the message is the engine's."""
    return ApiError(500, message, SERVER)


async def on_api_error(request: Request, exc: Exception) -> Response:
    """Render an ApiError."""
    assert isinstance(exc, ApiError)
    return exc.response()


async def on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 (and any other HTTPException) in the envelope instead of plain text."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message, code = f"Invalid URL ({request.method} {request.url.path})", "not_found"
    elif exc.status_code == 405:
        message, code = f"Method {request.method} is not allowed for {request.url.path}", "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return JSONResponse(envelope(message, INVALID, None, code), status_code=exc.status_code, headers=exc.headers)


async def on_unexpected(request: Request, exc: Exception) -> Response:
    """A bug: log it and answer 500 in the envelope rather than a bare traceback page."""
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(envelope(f"internal error: {type(exc).__name__}", SERVER), status_code=500)


HANDLERS = {ApiError: on_api_error, HTTPException: on_http_error, Exception: on_unexpected}
