"""The policy server's errors, and the one place any failure becomes an OpenAI-style error.

Routes raise ``APIError`` subclasses; the engine raises ``EngineError`` (``engine/requests.py``,
which carries its own HTTP status); pydantic raises ``ValidationError`` for a body that does not
fit its model; Starlette raises ``HTTPException`` for an unknown route; JSON nested past
Python's recursion limit raises ``RecursionError`` (a 400). ``as_api_error`` turns each into an
``APIError``, ``error_response`` into ``{"error": {message, type, param, code}}`` with its status
(and ``Retry-After`` when the server is overloaded), and ``install_error_handlers`` (called by
``app.create_app``) routes every exception of the app there. The streaming routes use
``error_body`` for an error mid-stream. Anthropic's Messages route (``/v1/messages``) answers in
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}`` (``messages_protocol``),
with the same status. A failure of the server itself is logged with its
traceback and answered with a fixed message: no exception text reaches a response body.
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from spanrl.trainer_bridge.torch_backend.engine.requests import EngineError, EngineOverloadedError
from spanrl.trainer_bridge.torch_backend.server.messages_protocol import MESSAGES_PATH, AnthropicError, anthropic_error
from spanrl.trainer_bridge.torch_backend.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """A request the server answers with an error: ``status``, OpenAI's ``type``, the request
    field at fault (``param``) and a machine-readable ``code``."""

    status = 400
    error_type = "invalid_request_error"
    retry_after_s: float | None = None  # set: the response carries Retry-After (a 503 that may pass)

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


class PermissionDeniedError(APIError):
    """403: a known caller asking for what it may not do (an agent's token loading weights)."""

    status = 403
    error_type = "permission_error"


class ConflictError(APIError):
    """409: a request that contradicts the server's state (weights not newer than the serving ones)."""

    status = 409


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
        if isinstance(exc, EngineOverloadedError):
            error.retry_after_s = exc.retry_after_s
        return error
    if isinstance(exc, RecursionError):  # JSON nested deeper than Python recurses: the client's doing
        return InvalidRequestError("the request body is nested too deeply", code="nested_too_deeply")
    if isinstance(exc, ValidationError):
        problems = exc.errors()
        described = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in problems[:5])
        first = ".".join(str(p) for p in problems[0]["loc"]) if problems else ""
        return UnprocessableRequestError(f"invalid request: {described}", first or None)
    if isinstance(exc, StarletteHTTPException):  # unknown route, wrong method
        return APIError(str(exc.detail), status=exc.status_code)
    logger.error("unexpected server error", exc_info=exc)
    return InternalServerError("internal error (its details are in the server's log)")


def error_body(exc: BaseException) -> ErrorResponse:
    """The ``{"error": {...}}`` body of an exception (also sent as an SSE event mid-stream)."""
    return _body_of(as_api_error(exc))


def anthropic_error_body(exc: BaseException) -> AnthropicError:
    """The Anthropic-shaped body of an exception (also sent as an ``error`` event mid-stream)."""
    error = as_api_error(exc)
    return anthropic_error(error.status, error.message)


def error_response(exc: BaseException, path: str = "") -> Response:
    """The one place an exception becomes an HTTP response (``path``: the route it answers)."""
    error = as_api_error(exc)
    headers = {} if error.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
    body = anthropic_error(error.status, error.message) if path == MESSAGES_PATH else _body_of(error)
    return Response(body.to_json(), status_code=error.status, media_type="application/json", headers=headers)


def _body_of(error: APIError) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=error.message, type=error.error_type, param=error.param,
                                         code=error.code))


def install_error_handlers(app: FastAPI) -> None:
    """Every failure of ``app`` becomes an error body; none crashes the server."""

    async def handle(request: Request, exc: Exception) -> Response:
        return error_response(exc, request.url.path)

    for kind in (Exception, StarletteHTTPException, APIError, EngineError, ValidationError):
        app.add_exception_handler(kind, handle)


__all__ = ["APIError", "AuthenticationError", "ConflictError", "InternalServerError", "InvalidRequestError",
           "NotFoundError", "PermissionDeniedError", "RequestTooLarge", "UnprocessableRequestError",
           "anthropic_error_body", "as_api_error", "error_body", "error_response", "install_error_handlers"]
