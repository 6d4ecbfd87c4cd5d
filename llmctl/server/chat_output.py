"""A chat choice's text as the client sees it: `<think>` reasoning split into `reasoning_content`, tool
calls parsed into `tool_calls` (`finish_reason: "tool_calls"`), whole or as stream deltas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from llmctl.server.reasoning import REASONING_PARSERS, ReasoningStream
from llmctl.server.tool_parsers import TOOL_PARSERS, ToolCallStream, ToolParser, new_call_id, tool_call_json
from llmctl.server.tool_parsers.forced import NamedToolParser, RequiredToolParser


@dataclass(frozen=True)
class ChatOutputSpec:
    """How a request's output is read: the reasoning parser (None: all content) and the tool parser
    (None: calls are not looked for: no tools, tool_choice "none", or no --enable-auto-tool-choice)."""
    reasoning_parser: Optional[str] = None
    tool_parser: Optional[str] = None
    # tool_choice "required" / a named function: the output is what `tool_call_schema` enforces.
    required_tool: bool = False
    named_tool: Optional[str] = None

    def tool_call_parser(self) -> Optional[ToolParser]:
        if self.named_tool is not None:
            return NamedToolParser(self.named_tool)
        if self.required_tool:
            return RequiredToolParser()
        return TOOL_PARSERS[self.tool_parser]() if self.tool_parser else None


def needs_special_tokens(spec: Optional[ChatOutputSpec]) -> bool:
    """Whether the output must keep special tokens for its tool parser to see its marker."""
    parser = spec.tool_call_parser() if spec is not None else None
    return parser is not None and parser.needs_special_tokens


def _finish_reason(spec: ChatOutputSpec, reason: Optional[str], called: bool) -> Optional[str]:
    """"tool_calls" where the model stopped after calling (as vLLM: not for a named function)."""
    return "tool_calls" if called and reason == "stop" and spec.named_tool is None else reason


class _ChoiceStream:
    def __init__(self, spec: ChatOutputSpec):
        reasoning = spec.reasoning_parser
        self.reasoning = ReasoningStream(REASONING_PARSERS[reasoning]()) if reasoning else None
        parser = spec.tool_call_parser()
        self.tools = ToolCallStream(parser) if parser is not None else None

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta


class ChatOutput:
    """The output reading of one chat request's choices (`spec` None: the text as it is)."""

    def __init__(self, spec: Optional[ChatOutputSpec]):
        self.spec = spec
        self._streams: dict[int, _ChoiceStream] = {}

    def delta(self, index: int, text: str, has_tokens: bool,
              reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """A stream chunk's `delta` and `finish_reason` for choice `index`'s new text."""
        if self.spec is None:
            return ({"content": text} if text or has_tokens else {}), reason
        stream = self._streams.setdefault(index, _ChoiceStream(self.spec))
        delta = stream.feed(text, final=reason is not None)
        if not delta and has_tokens:
            delta = {"content": ""}
        return delta, _finish_reason(self.spec, reason, stream.tools is not None and stream.tools.called)

    def message(self, text: str, reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """A whole body's `message` fields (role aside) and `finish_reason`."""
        if self.spec is None:
            return {"content": text}, reason
        message: dict[str, Any] = {}
        if self.spec.reasoning_parser:
            split = REASONING_PARSERS[self.spec.reasoning_parser]().split(text, final=True)
            message["reasoning_content"], text = split.reasoning, split.content
        message["content"] = text
        parser = self.spec.tool_call_parser()
        if parser is None:
            return message, reason
        parsed = parser.extract(text)
        if parsed.calls:
            message["content"] = parsed.content if parsed.content.strip() else None
            message["tool_calls"] = [tool_call_json(call, new_call_id()) for call in parsed.calls]
        return message, _finish_reason(self.spec, reason, bool(parsed.calls))
