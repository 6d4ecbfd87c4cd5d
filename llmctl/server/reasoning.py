"""Reasoning parsers by their `--reasoning-parser` names (vLLM's): split `<think>...</think>` off a
model's output into `reasoning_content`, whole or as a stream of deltas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from llmctl.server.tool_parsers.base import held_back

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: Optional[str]  # None: the output has no reasoning part
    content: str


class ReasoningParser:
    """DeepSeek-R1 style (`deepseek_r1`): the output reasons from its start (the template may already
    have written `<think>`) until `</think>`; an output that never closes it is all reasoning."""
    name = "deepseek_r1"

    def starts_reasoning(self, text: str) -> Optional[bool]:
        """Whether the output opens with reasoning (None: too little text to tell)."""
        return True

    def split(self, text: str, final: bool) -> ReasoningSplit:
        """The text's reasoning and content so far; not `final`, an end that may be the start of a
        tag is held back."""
        opens = self.starts_reasoning(text)
        if opens is None and not final:
            return ReasoningSplit(None, "")
        if not opens:
            return ReasoningSplit(None, text)
        body_start = text.find(THINK_START)
        body_start = body_start + len(THINK_START) if body_start >= 0 and not text[:body_start].strip() else 0
        end = text.find(THINK_END, body_start)
        if end < 0:
            keep = 0 if final else max(held_back(text, THINK_END), held_back(text, THINK_START))
            return ReasoningSplit(text[body_start:len(text) - keep], "")
        return ReasoningSplit(text[body_start:end], text[end + len(THINK_END):])


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (`qwen3`): reasoning only when the output opens with `<think>` (with thinking disabled
    the model answers directly, and that answer is content)."""
    name = "qwen3"

    def starts_reasoning(self, text: str) -> Optional[bool]:
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            return True
        return None if THINK_START.startswith(stripped) else False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (ReasoningParser, Qwen3ReasoningParser)}


class ReasoningStream:
    """One choice's stream: feed it deltas, get the reasoning and content deltas not yet sent."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.reasoning_sent = 0
        self.content_sent = 0

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        split = self.parser.split(self.text, final)
        reasoning = (split.reasoning or "")[self.reasoning_sent:]
        content = split.content[self.content_sent:]
        self.reasoning_sent += len(reasoning)
        self.content_sent += len(content)
        return reasoning, content
