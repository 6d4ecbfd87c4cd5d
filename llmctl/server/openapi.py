"""The OpenAPI document served at `/openapi.json`, made to say what the server does.

FastAPI documents a 422 validation error on every route with a body; this server answers 400 with
OpenAI's error body instead (`errors.py`), and its middlewares answer 401/408/413/429/503 before
any route runs (403: an API key's attributes, checked by the route). Fuzzers and client generators read this document, so it lists those answers, with
the one error schema they all share. The request schemas are the pydantic models, corrected where
the server differs: an optional field accepts null (its default), a field the server refuses lists
only the values that pass, `max_tokens` and `n` carry this server's caps, and the answers name
their real content types (Prometheus text, Server-Sent Events).
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from llmctl.engine.sampling_params import MAX_LOGPROBS
from llmctl.server.protocol import MAX_N, ChatCompletionRequest, CompletionRequest, unsupported_fields

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


# What /metrics answers (`app.py` sends it): Prometheus' classic text format, which every scraper reads.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BODIES = {"CompletionRequest": CompletionRequest, "ChatCompletionRequest": ChatCompletionRequest}
# The refusals `protocol.check_unsupported` makes outside its table: schema -> field -> (what, values that pass).
_REFUSED_ELSEWHERE: dict[str, dict[str, tuple[str, tuple]]] = {
    "CompletionRequest": {"suffix": ("insertion", ("",))},
    "ChatMessage": {"function_call": ("function calling", ()), "audio": ("audio", ())},
}


def install_openapi(app: FastAPI, max_output_tokens: Optional[int] = None) -> None:
    """Serve the corrected document (built once, on first request) at /openapi.json; `max_output_tokens`
    is the server's cap on `max_tokens` (--max-output-tokens)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # GET+HEAD /health share an operation id: made unique below
                warnings.filterwarnings("ignore", message="Duplicate Operation ID")
                document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = _truthful(document, max_output_tokens)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _truthful(document: dict[str, Any], max_output_tokens: Optional[int]) -> dict[str, Any]:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    for name, schema in schemas.items():  # every request model takes null for an optional field
        _nullable_optionals(schema)
        _refused_fields(schema, _REFUSED_ELSEWHERE.get(name, {}))
        if name in _BODIES:
            _refused_fields(schema, unsupported_fields(_BODIES[name]))
            _caps(schema, max_output_tokens)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            if "operationId" in operation:
                operation["operationId"] = f"{operation['operationId'].removesuffix('_get')}_{method}"
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            _content_types(path, responses)
            for status in _errors_for(path, method):
                responses[str(status)] = {"description": _ERRORS[status], "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    return document


def _nullable_optionals(schema: dict[str, Any]) -> None:
    """`null` in an optional field means its default (`protocol`'s bodies drop it before validating)."""
    required = set(schema.get("required", ()))
    for name, field in schema.get("properties", {}).items():
        if name in required or _allows_null(field):
            continue
        keep = {key: field.pop(key) for key in ("title", "default", "description") if key in field}
        schema["properties"][name] = {"anyOf": [field, {"type": "null"}], **keep}


def _allows_null(field: dict[str, Any]) -> bool:
    return (field == {} or field.get("type") == "null"
            or any(_allows_null(option) for option in [*field.get("anyOf", []), *field.get("oneOf", [])]))


def _refused_fields(schema: dict[str, Any], refused: dict[str, tuple[str, tuple]]) -> None:
    """A field the server does not implement passes only as null or the value meaning "off"."""
    for name, (what, accepted) in refused.items():
        if name not in schema.get("properties", {}):
            continue
        values: list[Any] = [] if name in schema.get("required", ()) else [None]
        for value in accepted:  # once each as JSON sees them: 1.0 and 1 are one value, False and 0 two
            if not any(value == seen and isinstance(value, bool) == isinstance(seen, bool) for seen in values):
                values.append(value)
        schema["properties"][name] = {"enum": values, "title": schema["properties"][name].get("title", name),
                                      "description": f"Not supported by this server ({what}): only these values pass."}


def _caps(schema: dict[str, Any], max_output_tokens: Optional[int]) -> None:
    """The server's caps on `n` and on the tokens to generate (`protocol`'s `_resolve_max_tokens`)."""
    properties = schema.get("properties", {})
    _bound(properties["n"], "integer", minimum=1, maximum=MAX_N)
    cap = {"maximum": max_output_tokens} if max_output_tokens is not None else {}
    _token_ids_only(properties)
    _sampling_ranges(properties)
    schema.setdefault("allOf", []).append(  # stream_options only with stream: true
        {"if": _given("stream_options", {"type": "object"}), "then": _given("stream", {"const": True})})
    tokens = properties["max_tokens"]
    if "max_completion_tokens" in properties:  # chat: max_tokens counts only without max_completion_tokens
        _bound(properties["max_completion_tokens"], "integer", minimum=1, **cap)
        schema.setdefault("allOf", []).extend([
            {"if": _given("max_completion_tokens", {"type": "integer"}),
             "else": {"properties": {"max_tokens": {"anyOf": [{"type": "integer", "minimum": 1, **cap},
                                                              {"type": "null"}]}}}},
            {"if": _given("top_logprobs", {"type": "integer"}), "then": _given("logprobs", {"const": True})}])
        return
    _bound(tokens, "integer", minimum=1, **cap)
    if max_output_tokens is not None and (tokens.get("default") or 0) > max_output_tokens:
        schema["required"] = [*schema.get("required", []), "max_tokens"]  # its default (also null's) is over the cap
        tokens["anyOf"] = [option for option in tokens.get("anyOf", [tokens]) if option.get("type") != "null"]
    # completions: 0 only with echo (the prompt scored, nothing generated)
    properties["max_tokens"] = {"anyOf": [tokens, {"type": "integer", "const": 0}],
                                "description": "0 only with echo: true (the prompt scored, nothing generated)"}
    schema.setdefault("allOf", []).append({"if": _given("max_tokens", {"const": 0}), "then": _given("echo", {"const": True})})
    if "best_of" in properties:  # no best-of ranking: only best_of == n passes, which changes nothing
        properties["best_of"] = {"type": "null", "title": "Best Of",
                                 "description": "Not supported by this server (best-of ranking); n's own value passes."}


# SamplingParams' ranges (engine/sampling_params.py), as JSON Schema bounds.
_SAMPLING_RANGES: dict[str, dict[str, float]] = {
    "temperature": {"minimum": 0.0}, "top_p": {"exclusiveMinimum": 0.0, "maximum": 1.0}, "top_k": {"minimum": -1},
    "min_p": {"minimum": 0.0, "maximum": 1.0}, "repetition_penalty": {"exclusiveMinimum": 0.0},
    "presence_penalty": {"minimum": -2.0, "maximum": 2.0}, "frequency_penalty": {"minimum": -2.0, "maximum": 2.0},
    "min_tokens": {"minimum": 0}, "logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS}, "prompt_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
}


def _sampling_ranges(properties: dict[str, Any]) -> None:
    for name, limits in _SAMPLING_RANGES.items():
        for option in _options(properties.get(name, {})):
            if option.get("type") in ("number", "integer"):
                option.update(limits)
    for option in _options(properties.get("logit_bias", {})):
        if option.get("type") == "object":  # keys are token ids, written as decimal strings
            option["propertyNames"] = {"pattern": "^(0|[1-9][0-9]*)$"}


def _token_ids_only(properties: dict[str, Any]) -> None:
    """Token ids are >= 0, and a prompt (or one prompt of a list) is not empty."""
    for name in ("prompt", "stop_token_ids"):
        for option in _options(properties.get(name, {})):
            if option.get("type") == "string" and name == "prompt":
                option["minLength"] = 1
            if option.get("type") != "array":
                continue
            if name == "prompt":
                option["minItems"] = 1
            for item in _options(option.get("items", {})):
                if item.get("type") == "integer":
                    item["minimum"] = 0
                elif item.get("type") == "string":
                    item["minLength"] = 1
                elif item.get("type") == "array":
                    item["minItems"] = 1
                    item.setdefault("items", {})["minimum"] = 0


def _options(field: dict[str, Any]) -> list[dict[str, Any]]:
    return [field, *field.get("anyOf", [])]


def _given(name: str, value_schema: dict[str, Any]) -> dict[str, Any]:
    """The condition "field `name` is present and matches `value_schema`"."""
    return {"required": [name], "properties": {name: value_schema}}


def _bound(field: dict[str, Any], kind: str, **limits: int) -> None:
    for option in [field] + field.get("anyOf", []):
        if option.get("type") == kind:
            option.update(limits)


def _content_types(path: str, responses: dict[str, Any]) -> None:
    ok = responses.get("200")
    if ok is None:
        return
    if path == "/metrics":
        ok["content"] = {METRICS_CONTENT_TYPE: {"schema": {"type": "string"}}}
    elif path in ("/v1/completions", "/v1/chat/completions"):
        ok["description"] = "The answer; with `stream: true`, Server-Sent Events ending in `data: [DONE]`"
        ok.setdefault("content", {})["text/event-stream"] = {}  # events of JSON chunks, then `[DONE]`


def _errors_for(path: str, method: str) -> list[int]:
    if not path.startswith("/v1/"):
        return [500, 503] if path == "/health" else [500]
    statuses = [401, 403, 404, 429, 500, 503]
    if method == "post":
        statuses += [400, 408, 413, 504]
    return sorted(statuses)
