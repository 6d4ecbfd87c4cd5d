"""How request bodies become JSON: strictly, and without stalling the event loop.

The C JSON parser holds the GIL for its whole run: 8 MiB of numbers (a 4.2 M-id token prompt)
took it ~0.3 s, and pydantic's validation of the result another ~0.2 s, with every other request
(`/health` included) waiting, 0.7 s in all on a busy host. A body with that many values is parsed
in a worker thread by the pure-Python scanner instead, which lets the event loop run between
values, and any array or object longer than any valid request could hold is refused there,
before validation. Python's JSON extensions `NaN`, `Infinity` and `-Infinity` are refused always.
A whole number written with a fraction or exponent (`2.0`, `1e3`) is the integer JSON Schema says it
is: parsed as an int, so the strict request models take it wherever they take an integer.
"""

from __future__ import annotations

import asyncio
import json
import json.scanner
from typing import Any, Callable

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

# Bodies with more commas than this take the thread path; below it the C parser takes ~10 ms.
C_PARSER_MAX_VALUES = 100_000
ARRAY_LIMIT_KEY = "llmctl_json_array_limit"


class StrictJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict_handler


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if body.count(b",") <= C_PARSER_MAX_VALUES:
                self._json = json.loads(body, parse_constant=_refuse_constant, parse_float=_number)
            else:
                limit = getattr(self.app.state, ARRAY_LIMIT_KEY, None)
                self._json = await asyncio.to_thread(_parse_in_python, body, limit)
        return self._json


def _refuse_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not a JSON value", name, 0)


def _number(literal: str) -> float | int:
    value = float(literal)
    return int(value) if value.is_integer() else value


def _parse_in_python(body: bytes, array_limit: int | None) -> Any:
    decoder = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_number)
    if array_limit is not None:
        # Counted while parsing, so an oversized array is refused at its (limit+1)-th item, never built whole.
        decoder.parse_array = _limited(json.decoder.JSONArray, array_limit, "array")
        decoder.parse_object = _limited(json.decoder.JSONObject, array_limit, "object")
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # bytecode: the GIL is released between values
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"the body is not UTF-8 ({exc.reason})", "", exc.start) from None
    return decoder.decode(text)


def _limited(parse: Callable, limit: int, kind: str) -> Callable:
    """`parse` (the stdlib's JSONArray or JSONObject) refusing its container's (limit+1)-th value."""
    def parse_limited(s_and_end: tuple, *args: Any) -> Any:
        scan_index = 0 if kind == "array" else 1  # JSONObject(s_and_end, strict, scan_once, ...)
        scan_once, count = args[scan_index], 0

        def counting_scan(text: str, end: int) -> Any:
            nonlocal count
            count += 1
            if count > limit:
                raise HTTPException(400, f"the body holds a JSON {kind} of more than {limit} items; "
                                         f"no valid request to this model has more than {limit}")
            return scan_once(text, end)

        return parse(s_and_end, *args[:scan_index], counting_scan, *args[scan_index + 1:])

    return parse_limited
