"""The OpenAPI document served at `/openapi.json`, made to say what the server does.

FastAPI documents a 422 validation error on every route with a body; this server answers 400 with
OpenAI's error body instead (`errors.py`), and its middlewares answer 401/408/413/429/503 before
any route runs (403: an API key's attributes, checked by the route). Fuzzers and client generators read this document, so it lists those answers, with
the one error schema they all share. The request schemas are the pydantic models themselves.
"""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "additionalProperties": False,
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}

# status -> when; which routes can answer it is decided in `_errors_for`.
_ERRORS = {
    400: "Invalid request: malformed JSON, wrong types, values out of range, unsupported fields, "
         "prompt too long for the context",
    401: "Missing or wrong API key (when the server has one)",
    403: "The API key may not use this model (or, on generation routes, this priority) (--api-keys)",
    404: "Unknown model or route",
    408: "The request body did not arrive within --timeout-body",
    413: "Request body over --max-body-size",
    429: "Over --rate-limit or --auth-failure-limit for this client, or over the API key's rate limits",
    500: "A server bug, or a failed engine step",
    503: "Warming up, over capacity, too many connections, or the engine is not serving",
    504: "The request ran past --request-timeout",
}


def install_openapi(app: FastAPI) -> None:
    """Serve the corrected document (built once, on first request) at /openapi.json."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # GET+HEAD /health share an operation id: made unique below
                warnings.filterwarnings("ignore", message="Duplicate Operation ID")
                document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = _truthful(document)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _truthful(document: dict[str, Any]) -> dict[str, Any]:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            if "operationId" in operation:
                operation["operationId"] = f"{operation['operationId'].removesuffix('_get')}_{method}"
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in _errors_for(path, method):
                responses[str(status)] = {"description": _ERRORS[status], "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    return document


def _errors_for(path: str, method: str) -> list[int]:
    if not path.startswith("/v1/"):
        return [500, 503] if path == "/health" else [500]
    statuses = [401, 403, 404, 429, 500, 503]
    if method == "post":
        statuses += [400, 408, 413, 504]
    return sorted(statuses)
