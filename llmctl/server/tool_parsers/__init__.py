"""Tool-call parsers by their `--tool-call-parser` names (vLLM's): each reads one model family's calls."""

from __future__ import annotations

from llmctl.server.tool_parsers.base import ParsedText, ToolCallStream, ToolCallText, ToolParser, new_call_id, tool_call_json
from llmctl.server.tool_parsers.hermes import HermesToolParser
from llmctl.server.tool_parsers.llama3_json import Llama3JsonToolParser
from llmctl.server.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in
                                              (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}

__all__ = ["TOOL_PARSERS", "ParsedText", "ToolCallStream", "ToolCallText", "ToolParser", "new_call_id",
           "tool_call_json"]
