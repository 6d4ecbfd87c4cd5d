"""Tool calling's request side: the server's settings (`--enable-auto-tool-choice`, `--tool-call-parser`,
`--reasoning-parser`), what `tool_choice` means for one request (the tools its template renders, how its
output is read) and the JSON schema that would enforce `required` or a named tool."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from llmctl.server.chat_output import ChatOutputSpec
from llmctl.server.errors import APIError
from llmctl.server.reasoning import REASONING_PARSERS
from llmctl.server.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True)
class ChatFeatures:
    """The server's tool-calling and reasoning settings (validated in `validate`)."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    # vLLM's --exclude-tools-when-tool-choice-none: by default tool_choice "none" still renders the tools.
    exclude_tools_when_tool_choice_none: bool = False

    def validate(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not one of: {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r} is not one of: "
                             f"{', '.join(REASONING_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


def tool_choice_of(body: Any) -> str:
    """"none", "auto", "required" or "named"; OpenAI's default: "auto" with tools, "none" without."""
    choice = getattr(body, "tool_choice", None)  # /tokenize's chat bodies have none
    if choice is None:
        return "auto" if body.tools else "none"
    return choice if isinstance(choice, str) else "named"


def check_tool_choice(body: Any, features: ChatFeatures) -> None:
    """Refuse a tool_choice this server cannot honour, with what would make it work."""
    choice = tool_choice_of(body)
    if choice != "none" and not body.tools:
        raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice == "named":
        name = body.tool_choice.function.name
        if name not in {tool.function.name for tool in body.tools}:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                           param="tool_choice")
    if choice == "auto" and not features.enable_auto_tool_choice:
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                            "set on the server", param="tool_choice")


def template_tools(body: Any, features: ChatFeatures) -> Optional[list[dict[str, Any]]]:
    """The tools the chat template renders (its `tools` variable), as transformers passes them."""
    if not body.tools:
        return None
    if tool_choice_of(body) == "none" and features.exclude_tools_when_tool_choice_none:
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def template_variables(body: Any, features: ChatFeatures, template_reads: frozenset[str]) -> dict[str, Any]:
    """What a chat request passes its template beside the messages: chat_template_kwargs, the tools
    (refused when the template cannot show them to the model) and reasoning_effort (the same)."""
    variables = dict(body.chat_template_kwargs or {})
    tools = template_tools(body, features)
    if tools is not None:
        if "tools" not in template_reads and tool_choice_of(body) != "none":
            raise APIError(400, "this model's chat template does not render tools, so the model cannot call them",
                           param="tools")
        variables["tools"] = tools
    effort = getattr(body, "reasoning_effort", None)  # /tokenize's chat bodies have none
    if effort is not None:
        if "reasoning_effort" not in template_reads:
            raise APIError(400, "reasoning_effort is not supported by this model: its chat template takes no "
                                "reasoning effort", param="reasoning_effort", code="unsupported_parameter")
        variables["reasoning_effort"] = effort
    return variables


def chat_output_spec(body: Any, features: ChatFeatures) -> Optional[ChatOutputSpec]:
    """How the request's output is read; None: as plain content."""
    choice = tool_choice_of(body)
    tool_parser = features.tool_call_parser if choice == "auto" and body.tools else None
    named = body.tool_choice.function.name if choice == "named" else None
    if tool_parser is None and named is None and choice != "required" and features.reasoning_parser is None:
        return None
    return ChatOutputSpec(reasoning_parser=features.reasoning_parser, tool_parser=tool_parser,
                          required_tool=choice == "required", named_tool=named)


def tool_call_schema(tools: list[dict[str, Any]], named: Optional[str] = None) -> dict[str, Any]:
    """The JSON schema of what the model may write under tool_choice "required" (an array of one or
    more calls, each `{"name": <a tool>, "parameters": <its parameters>}`, as vLLM's) or naming a
    function (that function's parameters alone)."""
    functions = [tool["function"] for tool in tools]
    if named is not None:
        return next(f.get("parameters") or {"type": "object"} for f in functions if f["name"] == named)
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                               "parameters": f.get("parameters") or {"type": "object"}},
              "required": ["name", "parameters"]} for f in functions]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def template_tool_calls(tool_calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates read them: arguments as an object (as vLLM
    passes them; Qwen and Llama templates `tojson` them), a string when they are not a JSON object."""
    out = []
    for call in tool_calls:
        arguments: Any = call.function.arguments
        try:
            parsed = json.loads(arguments)
            arguments = parsed if isinstance(parsed, dict) else arguments
        except json.JSONDecodeError:
            pass
        entry = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
        if call.id is not None:
            entry["id"] = call.id
        out.append(entry)
    return out
