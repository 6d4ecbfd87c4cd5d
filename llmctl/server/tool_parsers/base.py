"""What every tool parser shares: the calls read from a model's text (whole or so far), and the diff
that turns successive readings of a growing text into OpenAI's incremental `tool_calls` deltas."""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

from llmctl.server.tool_parsers.json_scan import Member, object_members, skip_space, string_value

ARGUMENT_KEYS = ("arguments", "parameters")  # hermes and mistral write "arguments", llama 3 "parameters"


@dataclass(frozen=True)
class ToolCallText:
    """One call as far as it is written: its name once complete, its arguments' raw JSON text so far."""
    name: Optional[str]
    arguments: str
    complete: bool


@dataclass(frozen=True)
class ParsedText:
    """A model's text split into its content (for the client) and its tool calls."""
    content: str
    calls: tuple[ToolCallText, ...]


def call_from_object(text: str, start: int) -> tuple[ToolCallText, Optional[int]]:
    """The call written as the JSON object opening at `text[start]` (`{"name": ..., "arguments": {...}}`),
    and the index past it once closed. Arguments are the model's own JSON text, so what a stream sends
    adds up to what a whole body holds."""
    members, end = object_members(text, start)
    by_key: dict[str, Member] = {m.key: m for m in members}
    arguments = next((by_key[key] for key in ARGUMENT_KEYS if key in by_key), None)
    raw = "" if arguments is None else text[arguments.start:arguments.end if arguments.end is not None else len(text)]
    if end is not None and arguments is None:
        raw = "{}"  # a call without arguments takes none
    return ToolCallText(string_value(text, by_key.get("name")), raw, end is not None), end


def calls_in_sequence(text: str, at: int, separator: str) -> list[ToolCallText]:
    """The calls written as JSON objects from `at` on, one after another with `separator` between them."""
    calls = []
    while at < len(text) and text[at] == "{":
        call, end = call_from_object(text, at)
        calls.append(call)
        if end is None:
            break
        at = skip_space(text, end)
        if text.startswith(separator, at):
            at = skip_space(text, at + len(separator))
    return calls


def without_calls(text: str, marker: str, final: bool) -> ParsedText:
    """`text` with no call in it: all content, but for an end that may still become `marker`, or
    `marker` itself while what follows it has not come (not `final`)."""
    first = text.find(marker)
    if not final and first >= 0 and not text[first + len(marker):].strip():
        return ParsedText(text[:first], ())
    keep = 0 if final else held_back(text, marker)
    return ParsedText(text[:len(text) - keep], ())


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (kept until known)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolParser(ABC):
    """One model family's way of writing tool calls (`--tool-call-parser`)."""
    name = ""
    # The marker is a special token the detokenizer would drop (mistral's [TOOL_CALLS]).
    needs_special_tokens = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedText:
        """The content and calls in `text`; not `final`, text that may still become a call is held back."""

    def extract(self, text: str) -> ParsedText:
        """A finished output's calls; all the text as content when any call is not valid JSON (as vLLM does)."""
        parsed = self.parse(text, final=True)
        if not parsed.calls or all(_valid(call) for call in parsed.calls):
            return parsed
        return ParsedText(text, ())


def _valid(call: ToolCallText) -> bool:
    if not (call.complete and call.name):
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except json.JSONDecodeError:
        return False


def new_call_id() -> str:
    """OpenAI's tool call ids: "call_" and random characters."""
    return "call_" + secrets.token_urlsafe(18).replace("-", "A").replace("_", "B")[:24]


def tool_call_json(call: ToolCallText, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class _SentCall:
    call_id: str
    arguments_sent: int = 0


@dataclass
class ToolCallStream:
    """One choice's stream: feed it the text so far, get the content and `tool_calls` deltas not yet sent."""
    parser: ToolParser
    text: str = ""
    content_sent: int = 0
    sent: list[_SentCall] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        return content, [d for index, call in enumerate(parsed.calls) if (d := self._delta(index, call))]

    def _delta(self, index: int, call: ToolCallText) -> Optional[dict[str, Any]]:
        if call.name is None or index > len(self.sent):
            return None  # a call is announced with its name, in order
        if index == len(self.sent):
            self.sent.append(_SentCall(new_call_id()))
            head = {"index": index, "id": self.sent[index].call_id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}
        else:
            head = {"index": index, "function": {}}
        sent = self.sent[index]
        more = call.arguments[sent.arguments_sent:]
        sent.arguments_sent = len(call.arguments)
        if not more and "id" not in head:
            return None
        head["function"]["arguments"] = more
        return head
