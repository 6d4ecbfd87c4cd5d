"""Tool-call and reasoning parsers on model outputs in each format (tests/fixtures/tool_outputs):
whole, and streamed in arbitrary chunks, which must add up to the same content and calls."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl.server.chat_output import ChatOutput, ChatOutputSpec
from llmctl.server.reasoning import REASONING_PARSERS
from llmctl.server.tool_calling import tool_call_schema
from llmctl.server.tool_parsers import TOOL_PARSERS, ToolCallStream

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "tool_outputs").glob("*.json"))
CASES = {path.stem: json.loads(path.read_text()) for path in FIXTURES}


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def _stream(parser_name: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Feed `pieces`, then assemble the deltas as the openai SDK does: content, and per call index its
    id and name (from its first delta) and the concatenated argument chunks."""
    stream = ToolCallStream(TOOL_PARSERS[parser_name]())
    content, calls, ids = "", {}, []
    for number, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, final=number == len(pieces) - 1)
        content += text
        for delta in deltas:
            if "id" in delta:
                assert delta["index"] == len(calls) and delta["type"] == "function"
                calls[delta["index"]] = [delta["function"]["name"], ""]
                ids.append(delta["id"])
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return content, [tuple(call) for call in calls.values()], ids


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_output_gives_the_recorded_content_and_calls(name):
    case = CASES[name]
    parsed = TOOL_PARSERS[case["parser"]]().extract(case["text"])
    assert parsed.content == case["content"]
    assert [(c.name, c.arguments) for c in parsed.calls] == [tuple(c) for c in case["calls"]]
    for call in parsed.calls:
        json.loads(call.arguments)


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_streamed_in_any_chunks_adds_up_to_the_whole(name, cuts):
    case = CASES[name]
    content, calls, ids = _stream(case["parser"], _chunks(case["text"], cuts))
    assert content == case["content"]
    assert calls == [tuple(c) for c in case["calls"]]
    assert all(i.startswith("call_") and len(i) > 10 for i in ids) and len(set(ids)) == len(ids)


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_token_by_token_announces_each_call_once_before_its_arguments(name):
    case = CASES[name]
    stream = ToolCallStream(TOOL_PARSERS[case["parser"]]())
    announced = []
    for number, char in enumerate(case["text"]):
        _, deltas = stream.feed(char, final=number == len(case["text"]) - 1)
        for delta in deltas:
            if "id" in delta:
                announced.append(delta["index"])
            else:
                assert delta["index"] in announced and set(delta) == {"index", "function"}
    assert announced == list(range(len(case["calls"])))


def test_a_call_that_is_not_json_leaves_the_text_as_content():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'  # the object never closes
    parsed = TOOL_PARSERS["hermes"]().extract(text)
    assert parsed.content == text and parsed.calls == ()


REASONING = [
    ("deepseek_r1", "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2 + 2 is 4.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", "<think>\nLet me think.\n</think>\n\n4", "\nLet me think.\n", "\n\n4"),
    ("deepseek_r1", "<think>Still thinking when max_tokens hit", "Still thinking when max_tokens hit", ""),
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "\n\nHello!"),
    ("qwen3", "Hello! How can I help?", None, "Hello! How can I help?"),
    ("qwen3", "<th", None, "<th"),
]


@pytest.mark.parametrize("parser, text, reasoning, content", REASONING)
def test_reasoning_whole_and_streamed(parser, text, reasoning, content):
    split = REASONING_PARSERS[parser]().split(text, final=True)
    assert (split.reasoning, split.content) == (reasoning, content)
    for seed in range(5):
        cuts = random.Random(seed).sample(range(len(text) + 1), k=min(len(text), 6))
        output = ChatOutput(ChatOutputSpec(reasoning_parser=parser))
        pieces = _chunks(text, cuts)
        got = {"reasoning_content": "", "content": ""}
        for number, piece in enumerate(pieces):
            delta, _ = output.delta(0, piece, True, "stop" if number == len(pieces) - 1 else None)
            for key in got:
                got[key] += delta.get(key, "")
        assert got == {"reasoning_content": reasoning or "", "content": content}


def test_reasoning_then_tool_call_streamed_and_whole_agree():
    text = ('<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    spec = ChatOutputSpec(reasoning_parser="qwen3", tool_parser="hermes")
    message, reason = ChatOutput(spec).message(text, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert message["reasoning_content"] == "\nI need the weather.\n"
    assert [(c["type"], c["function"]) for c in message["tool_calls"]] == [
        ("function", {"name": "get_weather", "arguments": '{"city": "Paris"}'})]
    output, reasoning, arguments, reasons = ChatOutput(spec), "", "", []
    for number in range(0, len(text), 7):
        delta, reason = output.delta(0, text[number:number + 7], True, "stop" if number + 7 >= len(text) else None)
        reasoning += delta.get("reasoning_content", "")
        arguments += "".join(c["function"]["arguments"] for c in delta.get("tool_calls", []))
        reasons.append(reason)
    assert reasoning == message["reasoning_content"] and arguments == '{"city": "Paris"}'
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]


def test_tool_call_schema_for_required_and_named():
    jsonschema = pytest.importorskip("jsonschema")
    required = tool_call_schema(TOOLS)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}],
                        required)
    for wrong in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required)
    named = tool_call_schema(TOOLS, named="get_weather")
    jsonschema.validate({"city": "Oslo"}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({}, named)


@pytest.mark.parametrize("spec, text, calls, reason", [
    (ChatOutputSpec(required_tool=True), '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
     '{"name": "now", "parameters": {}}]', [("get_weather", '{"city": "Oslo"}'), ("now", "{}")], "tool_calls"),
    (ChatOutputSpec(named_tool="get_weather"), ' {"city": "Oslo"}', [("get_weather", '{"city": "Oslo"}')], "stop"),
])
def test_grammar_enforced_tool_choice_output_whole_and_streamed(spec, text, calls, reason):
    """What `tool_call_schema` makes the model write reads back as calls (once the engine enforces it)."""
    message, got_reason = ChatOutput(spec).message(text, "stop")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == calls
    assert got_reason == reason and message["content"] is None
    output, streamed = ChatOutput(spec), {}
    for start in range(0, len(text), 3):
        delta, got_reason = output.delta(0, text[start:start + 3], True, "stop" if start + 3 >= len(text) else None)
        for call in delta.get("tool_calls", []):
            entry = streamed.setdefault(call["index"], [call["function"].get("name"), ""])
            entry[1] += call["function"]["arguments"]
    assert [tuple(v) for v in streamed.values()] == calls and got_reason == reason
