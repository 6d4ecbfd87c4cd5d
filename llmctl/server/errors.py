"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Owns the mapping from every failure the server can meet (validation, engine errors, unknown
routes, real bugs) to one status code and body, so no handler formats errors on its own.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmctl.engine.errors import (CapacityError, EngineDeadError, EngineError, EngineOverloadedError,
                                  InvalidRequestError, RequestTimeoutError, StepFailedError, StreamBacklogError)

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable",
          504: "timeout_error"}


class APIError(Exception):
    """An error answered with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None, error_type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.error_type = error_type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class StreamStalledError(Exception):
    """A stream's reader stopped reading: a write to it waited past `--timeout-stream-write`."""


class ClientDisconnectedError(Exception):
    """The client closed its connection before its answer was ready: its requests were aborted."""


def from_exception(exc: BaseException) -> APIError:
    """The API error for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), code="server_overloaded", headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, CapacityError):
        return APIError(503, str(exc), code="insufficient_capacity", headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, RequestTimeoutError):
        # 504, not 408, and told not to retry: the openai SDK retries 408 and every 5xx unless
        # x-should-retry says false, which would run a request that already took too long three times.
        return APIError(504, str(exc), code="request_timeout", headers={"x-should-retry": "false"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not serving: {exc}", code="engine_dead", headers={"Retry-After": "30"})
    if isinstance(exc, StreamBacklogError):
        return APIError(408, str(exc), code="stream_backlog_exceeded")
    if isinstance(exc, StepFailedError):
        return APIError(500, str(exc), code="engine_step_failed")
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error ({type(exc).__name__}); see the server log", code="internal_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}",
                        code="invalid_json")
    unknown = [_where(error) for error in errors if error.get("type") == "extra_forbidden"]
    if unknown:  # OpenAI's words for a key it does not know
        plural = "s" if len(unknown) > 1 else ""
        return APIError(400, f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}",
                        param=unknown[0], code="unknown_parameter")
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_type_tag(part)]
    where = ".".join(loc) or "body"
    message = f"invalid value for '{where}': {first.get('msg', 'invalid')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=loc[0] if loc else None, code="invalid_type")


def _where(error: dict) -> str:
    return ".".join(str(part) for part in error.get("loc", ()) if part != "body" and not _is_type_tag(part))


def _is_type_tag(part: object) -> bool:
    """pydantic names union members in error locations ('str', 'list[int]'): not field names."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "list", "dict", "none"}
                                      or "[" in part or part.startswith(("function-", "literal")))


def install_error_handlers(app: FastAPI) -> None:
    """Handlers for the errors a request can cause; real bugs are `middleware.InternalErrors`' job."""
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()

    @app.exception_handler(APIError)
    async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(EngineError)
    async def _on_engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return from_exception(exc).response()

