"""`--tool-call-parser llama3_json`: Llama 3.1+ answers a call with a JSON object
`{"name": ..., "parameters": {...}}` (after `<|python_tag|>` when special tokens are kept); calls
separated by `;`. Output that does not start with `{` is content."""

from __future__ import annotations

from llmctl.server.tool_parsers.base import ParsedText, ToolParser, calls_in_sequence
from llmctl.server.tool_parsers.json_scan import skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedText:
        start = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_space(text, start + len(PYTHON_TAG))
        elif PYTHON_TAG.startswith(text[start:]) and not final:
            return ParsedText("", ())  # maybe the tag, still arriving
        if start >= len(text):
            return ParsedText("" if not final else text, ())
        if text[start] != "{":
            return ParsedText(text, ())
        calls = calls_in_sequence(text, start, ";")
        return ParsedText("", tuple(calls))
