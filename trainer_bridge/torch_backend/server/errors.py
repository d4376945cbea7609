"""The policy server's errors, and the one place any failure becomes an OpenAI-style error.

Routes raise ``APIError`` subclasses; the engine raises ``EngineError`` (``engine/requests.py``,
which carries its own HTTP status); pydantic raises ``ValidationError`` for a body that does not
fit its model; Starlette raises ``HTTPException`` for an unknown route. ``as_api_error`` turns
each into an ``APIError``, ``error_response`` into ``{"error": {message, type, param, code}}``
with its status, and ``install_error_handlers`` (called by ``app.create_app``) routes every
exception of the app there. The streaming routes use ``error_body`` for an error mid-stream.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from spanrl.trainer_bridge.torch_backend.engine.requests import EngineError
from spanrl.trainer_bridge.torch_backend.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """A request the server answers with an error: ``status``, OpenAI's ``type``, the request
    field at fault (``param``) and a machine-readable ``code``."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        if status is not None:
            self.status = status


class InvalidRequestError(APIError):
    """400: a body that is not JSON, or values the server cannot serve."""


class UnprocessableRequestError(APIError):
    """422: a body that does not fit the request's schema."""

    status = 422


class AuthenticationError(APIError):
    """401: a missing or wrong bearer token."""

    status = 401
    error_type = "authentication_error"


class NotFoundError(APIError):
    """404: an unknown model or route."""

    status = 404


class RequestTooLarge(APIError):
    """413: a request body over the server's limit."""

    status = 413


class InternalServerError(APIError):
    """500: a failure of the server itself (logged with its traceback)."""

    status = 500
    error_type = "server_error"


def as_api_error(exc: BaseException) -> APIError:
    """The ``APIError`` an exception of any kind is answered with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        error = APIError(exc.message, exc.param, status=exc.status)
        error.error_type = exc.error_type
        return error
    if isinstance(exc, ValidationError):
        problems = exc.errors()
        described = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in problems[:5])
        first = ".".join(str(p) for p in problems[0]["loc"]) if problems else ""
        return UnprocessableRequestError(f"invalid request: {described}", first or None)
    if isinstance(exc, StarletteHTTPException):  # unknown route, wrong method
        return APIError(str(exc.detail), status=exc.status_code)
    logger.error("unexpected server error", exc_info=exc)
    return InternalServerError(f"internal error: {exc}")


def error_body(exc: BaseException) -> ErrorResponse:
    """The ``{"error": {...}}`` body of an exception (also sent as an SSE event mid-stream)."""
    return _body_of(as_api_error(exc))


def error_response(exc: BaseException) -> Response:
    """The one place an exception becomes an HTTP response."""
    error = as_api_error(exc)
    return Response(_body_of(error).to_json(), status_code=error.status, media_type="application/json")


def _body_of(error: APIError) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=error.message, type=error.error_type, param=error.param,
                                         code=error.code))


def install_error_handlers(app: FastAPI) -> None:
    """Every failure of ``app`` becomes an error body; none crashes the server."""

    async def handle(_request: Request, exc: Exception) -> Response:
        return error_response(exc)

    for kind in (Exception, StarletteHTTPException, APIError, EngineError, ValidationError):
        app.add_exception_handler(kind, handle)


__all__ = ["APIError", "AuthenticationError", "InternalServerError", "InvalidRequestError", "NotFoundError",
           "RequestTooLarge", "UnprocessableRequestError", "as_api_error", "error_body", "error_response",
           "install_error_handlers"]
