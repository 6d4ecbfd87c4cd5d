"""`--tool-call-parser mistral`: Mistral writes `[TOOL_CALLS]` (a special token, so it is decoded with
special tokens kept) then a JSON array of `{"name": ..., "arguments": {...}}` objects."""

from __future__ import annotations

from llmctl.server.tool_parsers.base import ParsedText, ToolParser, calls_in_sequence, without_calls
from llmctl.server.tool_parsers.json_scan import skip_space

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedText:
        first = text.find(MARKER)
        at = skip_space(text, first + len(MARKER)) if first >= 0 else len(text)
        if at >= len(text) or text[at] != "[":
            return without_calls(text, MARKER, final)
        calls = calls_in_sequence(text, skip_space(text, at + 1), ",")
        if not calls and final:
            return ParsedText(text, ())
        return ParsedText(text[:first], tuple(calls))
