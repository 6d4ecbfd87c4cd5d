"""How request bodies become JSON: strictly, and without stalling the event loop.

The C JSON parser holds the GIL for its whole run: 8 MiB of numbers (a 4.2 M-id token prompt)
took it ~0.3 s, and pydantic's validation of the result another ~0.2 s, with every other request
(`/health` included) waiting, 0.7 s in all on a busy host. A body with that many values is parsed
in a worker thread by the pure-Python scanner instead, which lets the event loop run between
values, and any array or object longer than any valid request could hold is refused there,
before validation. Python's JSON extensions `NaN`, `Infinity` and `-Infinity` are refused always.
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
                self._json = json.loads(body, parse_constant=_refuse_constant)
            else:
                limit = getattr(self.app.state, ARRAY_LIMIT_KEY, None)
                self._json = await asyncio.to_thread(_parse_in_python, body, limit)
        return self._json


def _refuse_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not a JSON value", name, 0)


def _parse_in_python(body: bytes, array_limit: int | None) -> Any:
    decoder = json.JSONDecoder(parse_constant=_refuse_constant)
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # bytecode: the GIL is released between values
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"the body is not UTF-8 ({exc.reason})", "", exc.start) from None
    value = decoder.decode(text)
    if array_limit is not None:
        _refuse_oversized(value, array_limit)
    return value


def _refuse_oversized(value: Any, limit: int) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if len(item) > limit if isinstance(item, (list, dict)) else False:
            raise HTTPException(400, f"the body holds a JSON {'array' if isinstance(item, list) else 'object'} of "
                                     f"{len(item)} items; no valid request to this model has more than {limit}")
        if isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, (list, dict)))
        elif isinstance(item, dict):
            stack.extend(v for v in item.values() if isinstance(v, (list, dict)))
