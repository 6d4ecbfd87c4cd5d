"""`--tool-call-parser hermes`: Hermes and Qwen2.5/Qwen3 write each call as `<tool_call>{json}</tool_call>`."""

from __future__ import annotations

from llmctl.server.tool_parsers.base import ParsedText, ToolParser, call_from_object, without_calls
from llmctl.server.tool_parsers.json_scan import skip_space

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedText:
        first = at = text.find(OPEN)
        calls = []
        while at >= 0:
            start = skip_space(text, at + len(OPEN))
            if start >= len(text) or text[start] != "{":
                break
            call, end = call_from_object(text, start)
            calls.append(call)
            if end is None:
                break
            at = text.find(OPEN, end)
        if not calls:
            return without_calls(text, OPEN, final)
        return ParsedText(text[:first], tuple(calls))
