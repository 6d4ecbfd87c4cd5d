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
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from llmctl.engine.pooling import PoolerConfig
from llmctl.engine.sampling_params import MAX_LOGPROBS
from llmctl.server.middleware import is_protected
from llmctl.server.protocol import (GUIDED_FIELDS, MAX_N, RESPONSE_FORMATS, ChatCompletionRequest, CompletionRequest,
                                    TokenizeChatRequest, unsupported_fields)

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
    409: "A profile is (or is not) being recorded already (--profile-dir)",
    500: "A server bug, or a failed engine step",
    503: "Warming up, over capacity, too many connections, or the engine is not serving",
    504: "The request ran past --request-timeout",
}


# What /metrics answers (`app.py` sends it): Prometheus' classic text format, which every scraper reads.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BODIES = {"CompletionRequest": CompletionRequest, "ChatCompletionRequest": ChatCompletionRequest,
           "TokenizeChatRequest": TokenizeChatRequest}
_GENERATION_BODIES = ("CompletionRequest", "ChatCompletionRequest")
# The refusals `protocol.check_unsupported` makes outside its table: schema -> field -> (what, values that pass).
_REFUSED_ELSEWHERE: dict[str, dict[str, tuple[str, tuple]]] = {
    "CompletionRequest": {"suffix": ("insertion", ("",))},
    "ChatMessage": {"function_call": ("function calling", ()), "audio": ("audio", ())},
}


@dataclass(frozen=True)
class ServedFacts:
    """What the request schemas depend on beyond the request models: the served model and flags."""
    max_output_tokens: Optional[int] = None  # --max-output-tokens: the cap on max_tokens
    vocab_size: Optional[int] = None  # token ids are below it
    priority_scheduling: bool = True  # False: only priority 0 is accepted
    template_variables: Optional[frozenset[str]] = None  # what the chat template reads (None: not known)
    pooler: Optional[PoolerConfig] = None  # how embeddings pool: which `dimensions` pass (None: not known)
    max_sequences_per_request: Optional[int] = None  # --max-seqs-per-request: the cap on embedding inputs


def install_openapi(app: FastAPI, facts: ServedFacts = ServedFacts()) -> None:
    """Serve the corrected document (built once, on first request) at /openapi.json."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # GET+HEAD /health share an operation id: made unique below
                warnings.filterwarnings("ignore", message="Duplicate Operation ID")
                document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = _truthful(document, facts)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _truthful(document: dict[str, Any], facts: ServedFacts) -> dict[str, Any]:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    for name, schema in schemas.items():  # every request model takes null for an optional field
        _nullable_optionals(schema)
        _refused_fields(schema, _REFUSED_ELSEWHERE.get(name, {}))
        if name in _BODIES:
            _refused_fields(schema, unsupported_fields(_BODIES[name]))
        if name in _GENERATION_BODIES:
            _caps(schema, facts.max_output_tokens, facts.max_sequences_per_request)
    _text_parts_only(schemas)
    _token_ids_in(schemas, facts.vocab_size)
    _served_features(schemas, facts)
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


def _caps(schema: dict[str, Any], max_output_tokens: Optional[int], max_sequences: Optional[int]) -> None:
    """The server's caps on `n` (one prompt's worth of --max-seqs-per-request; prompts x n is checked too, which
    a schema cannot say) and on the tokens to generate (`protocol`'s `_resolve_max_tokens`)."""
    properties = schema.get("properties", {})
    _bound(properties["n"], "integer", minimum=1, maximum=min(MAX_N, max_sequences or MAX_N))
    properties["n"]["description"] = "Sequences per prompt; prompts x n is at most --max-seqs-per-request (a 400 otherwise)."
    cap = {"maximum": max_output_tokens} if max_output_tokens is not None else {}
    _token_ids_only(properties)
    _sampling_ranges(properties)
    properties["min_tokens"]["description"] = "At most the tokens to generate (max_tokens): a 400 otherwise."
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


def _served_features(schemas: dict[str, Any], facts: ServedFacts) -> None:
    """Fields whose use depends on the model and flags: refused ones listed with the values that pass."""
    template = facts.template_variables
    for name in ("ChatCompletionRequest", "TokenizeChatRequest"):
        refused = {}
        if template is not None and "tools" not in template:
            refused["tools"] = ("tools: this model's chat template does not render them", ())
        if template is not None and "reasoning_effort" not in template:
            refused["reasoning_effort"] = ("reasoning_effort: this model's chat template does not read it", ())
        _refused_fields(schemas[name], refused)
    for name in _GENERATION_BODIES:
        if not facts.priority_scheduling:
            _refused_fields(schemas[name], {"priority": ("priorities other than 0: --scheduling-policy fcfs", (0,))})
        schemas[name].setdefault("allOf", []).append(_streamed_or_not())
        _one_output_constraint(schemas[name])
    structured = schemas["StructuredOutputsBody"]
    _constraint_kinds(structured["properties"], "json", "regex")
    _exactly_one_kind(structured)
    _response_format(schemas["ResponseFormat"], schemas["JsonSchemaFormat"])
    if "EmbeddingRequest" in schemas:
        _embedding_request(schemas["EmbeddingRequest"]["properties"], facts)


def _embedding_request(properties: dict[str, Any], facts: ServedFacts) -> None:
    """At most --max-seqs-per-request inputs; `dimensions` as the model's pooling allows."""
    if facts.max_sequences_per_request is not None:
        for option in _options(properties["input"]):
            if option.get("type") == "array" and option.get("items", {}).get("type") != "integer":
                option["maxItems"] = min(option.get("maxItems", facts.max_sequences_per_request),
                                         facts.max_sequences_per_request)
    if facts.pooler is not None:
        _embedding_dimensions(properties, facts.pooler)


def _embedding_dimensions(properties: dict[str, Any], pooler: PoolerConfig) -> None:
    """`dimensions` truncates a Matryoshka model's vector (to one of its listed sizes, when it lists them)."""
    field = properties["dimensions"]
    if not pooler.is_matryoshka:
        _refused_fields({"properties": properties}, {"dimensions": ("dimensions: this model is not Matryoshka", ())})
    elif pooler.matryoshka_dimensions:
        listed = sorted(d for d in pooler.matryoshka_dimensions if d <= pooler.hidden_size)
        field["anyOf"] = [{"enum": listed}, _null()]
    else:
        _bound(field, "integer", maximum=pooler.hidden_size)


def _constraint_kinds(properties: dict[str, Any], json_field: str, regex_field: str) -> None:
    """A JSON schema is advertised as an object (its string spelling, JSON text, is accepted too but no
    schema can say "a string holding a JSON schema"); a regex field holds a regular expression."""
    field = properties[json_field]
    field["anyOf"] = [option for option in field["anyOf"] if option.get("type") != "string"]
    for option in _options(properties[regex_field]):
        if option.get("type") == "string":
            option["format"] = "regex"


def _null() -> dict[str, Any]:
    return {"type": "null"}


def _streamed_or_not() -> dict[str, Any]:
    """Streamed (no prompt_logprobs, as in vLLM) or not (no stream_options): two branches, where an if/then per
    rule would double the alternatives a generator has to expand (schemathesis gives up on a body with too many)."""
    return {"anyOf": [{"required": ["stream"], "properties": {"stream": {"const": True}, "prompt_logprobs": _null()}},
                      {"properties": {"stream": {"enum": [False, None]}, "stream_options": _null()}}]}


_GUIDED_NOTE = (f"vLLM's older spellings {', '.join(GUIDED_FIELDS)} are accepted too (one output constraint in all) "
                "but not listed: each would add alternatives past what schema-driven generators expand.")


def _one_output_constraint(schema: dict[str, Any]) -> None:
    """At most one of response_format and structured_outputs (`protocol.structured_outputs`); the guided_*
    spellings, which count as one more, are told in the description instead of the schema."""
    for name in GUIDED_FIELDS:
        schema["properties"].pop(name, None)
    schema["description"] = f"{schema.get('description', '')}\n\n{_GUIDED_NOTE}".strip()
    schema.setdefault("allOf", []).append({"anyOf": [{"properties": {"response_format": _null()}},
                                                     {"properties": {"structured_outputs": _null()}}]})


def _exactly_one_kind(structured: dict[str, Any]) -> None:
    """vLLM's structured_outputs holds exactly one constraint: null (and json_object false) mean "not this one"."""
    given: dict[str, dict[str, Any]] = {}
    for name, field in structured["properties"].items():
        options = [option for option in _options(field)[1:] or [field] if option.get("type") != "null"]
        given[name] = options[0] if len(options) == 1 else {"anyOf": options}
    given["choice"]["minItems"] = 1
    given["regex"]["minLength"] = 1
    given["grammar"]["pattern"] = r"\S"  # a blank grammar is refused
    given["json_object"] = {"const": True}
    absent = {name: _null() for name in given} | {"json_object": {"enum": [False, None]}}
    structured["properties"] = {name: {"anyOf": [field, _null()]} for name, field in given.items()}
    structured["properties"]["json_object"] = {"type": ["boolean", "null"]}
    structured["anyOf"] = [{"required": [name], "properties": {**absent, name: field}} for name, field in given.items()]


def _response_format(response_format: dict[str, Any], json_schema: dict[str, Any]) -> None:
    """Its type is one of RESPONSE_FORMATS; json_schema needs the schema (an object, or true), which other types ignore."""
    response_format["properties"]["type"] = {"enum": list(RESPONSE_FORMATS), "title": "Type"}
    usable = {"anyOf": [{"type": "object"}, {"const": True}]}
    response_format.setdefault("allOf", []).append({
        "if": _given("type", {"const": "json_schema"}),
        "then": _given("json_schema", {"type": "object", **_given("schema", usable)})})
    json_schema["properties"]["schema"] = {"anyOf": [{"type": "object"}, {"type": "boolean"}, _null()], "title": "Schema"}


_MEDIA_PART_REF = "#/components/schemas/MediaPart"


def _text_parts_only(schemas: dict[str, Any]) -> None:
    """Image, audio and file parts are declared only to be refused by name (the models take text): not advertised."""
    if schemas.pop("MediaPart", None) is None:
        return
    for option in _options(schemas["ChatMessage"]["properties"]["content"]):
        items = option.get("items", {})
        if "anyOf" in items:
            kept = [part for part in items["anyOf"] if part.get("$ref") != _MEDIA_PART_REF]
            option["items"] = kept[0] if len(kept) == 1 else {**items, "anyOf": kept}


def _token_ids_in(schemas: dict[str, Any], vocab_size: Optional[int]) -> None:
    """Token ids (prompts, embedding inputs, /detokenize, logit_bias keys) are in [0, vocab_size); a stop token id past it passes
    (it never matches)."""
    if vocab_size is None:
        return
    id_fields = [(schemas[body]["properties"], field) for body, field in
                 (("CompletionRequest", "prompt"), ("EmbeddingRequest", "input")) if body in schemas]
    id_fields.append((schemas["DetokenizeRequest"]["properties"], "tokens"))
    for properties, name in id_fields:
        for option in _options(properties.get(name, {})):
            for item in _options(option.get("items", {})):
                for token in [item, *_options(item.get("items", {}))]:
                    if token.get("type") == "integer":
                        token.update(minimum=0, maximum=vocab_size - 1)
    for body in _GENERATION_BODIES:
        for option in _options(schemas[body]["properties"].get("logit_bias", {})):
            if option.get("type") == "object":
                option["propertyNames"] = {"pattern": f"^({_below(vocab_size)})$"}
                option["additionalProperties"] = {"type": "number", "minimum": -100, "maximum": 100}


def _below(bound: int) -> str:
    """A regex alternation matching exactly the decimal integers in [0, bound), without leading zeros."""
    top = str(bound - 1)
    alternatives = ["0"] + [f"[1-9][0-9]{{{length - 1}}}" for length in range(1, len(top))]
    for i, digit in enumerate(top):  # same prefix as `top`, a smaller digit here, anything after
        low = 1 if i == 0 else 0
        if int(digit) > low:
            smaller = f"[{low}-{int(digit) - 1}]" if int(digit) - 1 > low else str(low)
            alternatives.append(f"{top[:i]}{smaller}[0-9]{{{len(top) - i - 1}}}")
    alternatives.append(top)
    return "|".join(alternatives)


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
    """Every route may answer 500, and 503 (too many connections, shutting down); a protected route
    (API keys, rate limits: `middleware.is_protected`) 401/403/429; a body 400/408/413; a route naming
    a model 404; generation 504 (--request-timeout); the profiler 409."""
    statuses = {500, 503}
    if is_protected(path):
        statuses |= {401, 403, 429}
    if method == "post":
        statuses |= {400, 408, 413}
    if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
        statuses.add(404)
    if path in ("/v1/completions", "/v1/chat/completions"):
        statuses.add(504)
    if path in ("/start_profile", "/stop_profile"):
        statuses.add(409)
    return sorted(statuses)
