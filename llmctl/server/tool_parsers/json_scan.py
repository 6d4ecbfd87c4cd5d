"""A tolerant scanner for JSON that a model is still writing: where a value ends, and the members of an
object read so far, so a tool call's name and its arguments' raw text are known before the object closes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

_OPEN = {"{": "}", "[": "]"}
_WHITESPACE = " \t\r\n"


def skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at


def value_end(text: str, start: int) -> Optional[int]:
    """The index just past the JSON value starting at `start`, or None while it is unfinished
    (a number or literal counts as finished only when something follows it)."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in _OPEN:
        return _container_end(text, start)
    at = start
    while at < len(text) and text[at] not in ",}] \t\r\n":
        at += 1
    return at if at < len(text) else None


def _string_end(text: str, start: int) -> Optional[int]:
    at = start + 1
    while at < len(text):
        if text[at] == "\\":
            at += 2
            continue
        if text[at] == '"':
            return at + 1
        at += 1
    return None


def _container_end(text: str, start: int) -> Optional[int]:
    depth, at = 0, start
    while at < len(text):
        char = text[at]
        if char == '"':
            end = _string_end(text, at)
            if end is None:
                return None
            at = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return at + 1
        at += 1
    return None


@dataclass(frozen=True)
class Member:
    """One `"key": value` of an object: where its value starts, and ends (None: still being written)."""
    key: str
    start: int
    end: Optional[int]


def object_members(text: str, start: int) -> tuple[list[Member], Optional[int]]:
    """The members of the object opening at `text[start] == "{"` read so far, and the index past its
    closing brace (None while it is open). Text that is not JSON ends the scan where it begins."""
    members: list[Member] = []
    at = skip_space(text, start + 1)
    while at < len(text):
        if text[at] == "}":
            return members, at + 1
        if text[at] == ",":
            at = skip_space(text, at + 1)
            continue
        key_end = _string_end(text, at) if text[at] == '"' else None
        if key_end is None:
            break
        colon = skip_space(text, key_end)
        if colon >= len(text) or text[colon] != ":":
            break
        value_start = skip_space(text, colon + 1)
        if value_start >= len(text):
            break
        end = value_end(text, value_start)
        members.append(Member(json.loads(text[at:key_end]), value_start, end))
        if end is None:
            break
        at = skip_space(text, end)
    return members, None


def string_value(text: str, member: Optional[Member]) -> Optional[str]:
    """A finished string member's value (None if absent, unfinished or not a string)."""
    if member is None or member.end is None or text[member.start] != '"':
        return None
    return json.loads(text[member.start:member.end])
