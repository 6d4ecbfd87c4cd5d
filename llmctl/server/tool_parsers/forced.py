"""The output under a tool_choice a grammar enforces (`tool_call_schema`'s): "required" writes a JSON
array of `{"name", "parameters"}` calls; a named function has its arguments object written alone."""

from __future__ import annotations

from llmctl.server.tool_parsers.base import ParsedText, ToolCallText, ToolParser, calls_in_sequence
from llmctl.server.tool_parsers.json_scan import skip_space, value_end


class RequiredToolParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> ParsedText:
        at = skip_space(text, 0)
        if at >= len(text) or text[at] != "[":
            return ParsedText(text if final else "", ())
        return ParsedText("", tuple(calls_in_sequence(text, skip_space(text, at + 1), ",")))


class NamedToolParser(ToolParser):
    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool) -> ParsedText:
        arguments = text.lstrip()
        complete = final or (bool(arguments) and value_end(arguments, 0) is not None)
        return ParsedText("", (ToolCallText(self.function, arguments, complete),))
