"""Read a batch of prompts from a file or stdin: plain lines, or JSON lines with per-prompt params.

A JSON line is an object with `prompt` (text), `prompt_token_ids` or `messages` (chat), and any
`SamplingParams` field (`max_tokens`, `temperature`, ...) that overrides the command's flags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Optional

from llmctl.errors import UserError

PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")


@dataclass
class PromptSpec:
    prompt: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None
    messages: Optional[list[dict[str, Any]]] = None
    params: dict[str, Any] = field(default_factory=dict)


def sampling_field_names() -> set[str]:
    from llmctl.engine.sampling_params import SamplingParams

    return {f.name for f in fields(SamplingParams)} - {"logits_processors"}


def parse_prompt_lines(lines: Iterable[str], source: str) -> list[PromptSpec]:
    specs = []
    allowed = sampling_field_names()
    for number, line in enumerate(lines, start=1):
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.lstrip().startswith("{"):
            specs.append(_parse_json_line(text, f"{source}:{number}", allowed))
        else:
            specs.append(PromptSpec(prompt=text))
    if not specs:
        raise UserError(f"{source} holds no prompts")
    return specs


def _parse_json_line(text: str, where: str, allowed: set[str]) -> PromptSpec:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: invalid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: a JSON line must be an object")
    given = [k for k in PROMPT_KEYS if k in data]
    if len(given) != 1:
        raise UserError(f"{where}: give exactly one of {', '.join(PROMPT_KEYS)}")
    unknown = sorted(set(data) - set(PROMPT_KEYS) - allowed)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}")
    params = {k: v for k, v in data.items() if k in allowed}
    return PromptSpec(**{given[0]: data[given[0]]}, params=params)
