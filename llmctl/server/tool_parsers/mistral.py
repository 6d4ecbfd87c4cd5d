"""`--tool-call-parser mistral`: Mistral writes `[TOOL_CALLS]` (a special token, so it is decoded with
special tokens kept) then a JSON array of `{"name": ..., "arguments": {...}}` objects; tokenizers of
version 11 and later write `[TOOL_CALLS]name[ARGS]{...}` per call instead."""

from __future__ import annotations

from llmctl.server.tool_parsers.base import ParsedText, ToolCallText, ToolParser, calls_in_sequence, without_calls
from llmctl.server.tool_parsers.json_scan import skip_space, value_end

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedText:
        first = text.find(MARKER)
        at = skip_space(text, first + len(MARKER)) if first >= 0 else len(text)
        if at < len(text) and text[at] == "[" and not text.startswith(ARGS, at):
            calls = calls_in_sequence(text, skip_space(text, at + 1), ",")
        elif at < len(text):
            calls = _named_calls(text, first, final)
        else:
            calls = []
        if not calls and first >= 0 and not final:
            return ParsedText(text[:first], ())  # the marker only ever starts calls: wait for them
        if not calls:
            return without_calls(text, MARKER, final)
        return ParsedText(text[:first], tuple(calls))


def _named_calls(text: str, at: int, final: bool) -> list[ToolCallText]:
    """`[TOOL_CALLS]name[ARGS]{...}` repeated: each call's name, then its arguments object."""
    calls = []
    while text.startswith(MARKER, at):
        args = text.find(ARGS, at)
        if args < 0:
            return calls  # the next name is still arriving
        name = text[at + len(MARKER):args].strip()
        start = skip_space(text, args + len(ARGS))
        end = value_end(text, start) if start < len(text) and text[start] == "{" else None
        calls.append(ToolCallText(name, text[start:end if end is not None else len(text)], end is not None))
        if end is None:
            break
        at = skip_space(text, end)
    return calls
