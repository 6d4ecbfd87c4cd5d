"""Tool calling, reasoning and /tokenize on a real `llmctl serve` (the tiny chat model with a
Qwen2.5-style tools-aware template): the openai SDK, litellm, a langchain-openai agent loop and
instructor, unmodified; the refusals, and the shapes of tool calls and reasoning in bodies and streams (engine outputs in, OpenAI JSON out)."""

from __future__ import annotations

import json
import shutil
from typing import Literal

import jsonschema
import pydantic
import pytest

from llmctl.engine.outputs import CompletionOutput, RequestOutput
from llmctl.server.chat_output import ChatOutputSpec
from llmctl.server.protocol import ChatCompletionRequest, Prompt, ServerLimits, engine_params
from llmctl.server.responses import TokenTexts, shapes_for
from llmctl.server.tool_calling import ChatFeatures, template_tools, tool_call_schema
from server_helpers import openai_client, post_json, running_server

MODEL = "tiny-tools"
# What matters of Qwen2.5's template: the tools as JSON, an assistant's calls in <tool_call>, tool
# results in <tool_response>; and a reasoning_effort line when given one.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}{{ eos_token }}{% endif %}"
    "{% if reasoning_effort is defined %}<|system|>effort: {{ reasoning_effort }}{{ eos_token }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|user|><tool_response>{{ m.content }}</tool_response>{{ eos_token }}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}{% for call in m.tool_calls %}"
    "<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}{{ eos_token }}"
    "{% else %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc123", "content": "18 C, sunny"},
]


@pytest.fixture(scope="module")
def tools_model(tiny_chat_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(tiny_chat_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def server(tools_model):
    with running_server(tools_model, served_model_name=MODEL, max_output_tokens=16, enable_auto_tool_choice=True,
                        tool_call_parser="hermes", reasoning_parser="qwen3") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


_post = post_json


def _rendered(server, body: dict) -> str:
    tokens = _post(server, "/tokenize", body).json()["tokens"]
    return _post(server, "/detokenize", {"model": MODEL, "tokens": tokens}).json()["prompt"]


def test_openai_round_trip_with_tool_calls_and_tool_results_in_the_history(client, server):
    messages = HISTORY + [{"role": "user", "content": "And tomorrow?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = _rendered(server, {"model": MODEL, "messages": messages, "tools": TOOLS})
    assert json.dumps(TOOLS[0], ensure_ascii=False) in rendered  # the tools, as the template's `tools`
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered
    assert "<tool_response>18 C, sunny</tool_response>" in rendered
    usage = out.usage.prompt_tokens
    assert usage == _post(server, "/tokenize", {"model": MODEL, "messages": messages, "tools": TOOLS}).json()["count"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4,
                                                 stream=True, parallel_tool_calls=True))
    assert chunks[-1].choices[0].finish_reason is not None


def test_litellm_sends_tools_and_is_answered(server):
    litellm = pytest.importorskip("litellm")
    out = litellm.completion(model=f"openai/{MODEL}", api_base=server.base_url + "/v1", api_key="unused",
                             messages=HISTORY, tools=TOOLS, tool_choice="auto", max_tokens=4, num_retries=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_renders_the_tools_but_calls_nothing(server):
    plain = {"model": MODEL, "messages": HISTORY[:1]}
    assert "get_weather" in _rendered(server, {**plain, "tools": TOOLS})
    none = _post(server, "/v1/chat/completions", {**plain, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
    auto = _post(server, "/v1/chat/completions", {**plain, "tools": TOOLS, "max_tokens": 2})
    assert none.status_code == auto.status_code == 200
    assert none.json()["usage"]["prompt_tokens"] == auto.json()["usage"]["prompt_tokens"]
    body = ChatCompletionRequest.model_validate({"messages": HISTORY[:1], "tools": TOOLS, "tool_choice": "none"})
    assert template_tools(body, ChatFeatures(exclude_tools_when_tool_choice_none=True)) is None


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "already an output constraint"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     "messages.0.content", "takes text only"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "messages.0.content", "takes text only"),
])
def test_refusals_name_what_is_missing(server, extra, param, words):
    response = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": HISTORY[:1], "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_required_and_named_tool_choice_hold_the_output_to_the_tools_schema():
    """The grammar engine enforces tool_call_schema: an array of calls for "required", the named function's
    parameters for a named choice."""
    limits = ServerLimits(max_model_len=512, max_output_tokens=64, vocab_size=2048, max_sequences_per_request=16)
    for choice, spec in (("required", ChatOutputSpec(required_tool=True)),
                         ({"type": "function", "function": {"name": "get_weather"}}, ChatOutputSpec(named_tool="get_weather"))):
        body = ChatCompletionRequest.model_validate({"messages": HISTORY[:1], "tools": TOOLS, "tool_choice": choice})
        (params,) = engine_params(body, [Prompt(None, [1, 2, 3])], limits, chat_output=spec).sampling
        assert params.structured_outputs.json == tool_call_schema(TOOLS, spec.named_tool)
    assert tool_call_schema(TOOLS, "get_weather") == TOOLS[0]["function"]["parameters"]
    assert tool_call_schema(TOOLS)["minItems"] == 1


def test_a_named_tool_choice_is_answered_with_a_call_that_validates(server):
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"], "additionalProperties": False}}}]
    reply = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": HISTORY[:1], "tools": tools,
                                                   "tool_choice": {"type": "function", "function": {"name": "pick"}}})
    assert reply.status_code == 200, reply.text
    (call,) = reply.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "pick" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_auto_tool_choice_needs_the_server_flags(tiny_chat_model):
    with running_server(tiny_chat_model, served_model_name="plain") as srv:
        body = {"messages": HISTORY[:1], "tools": TOOLS, "max_tokens": 2}
        refused = _post(srv, "/v1/chat/completions", body)
        assert refused.status_code == 400 and "--enable-auto-tool-choice" in refused.json()["error"]["message"]
        # tool_choice none: accepted (this template shows no tools, and none are called)
        assert _post(srv, "/v1/chat/completions", {**body, "tool_choice": "none"}).status_code == 200
        effort = _post(srv, "/v1/chat/completions", {**body, "tool_choice": "none", "reasoning_effort": "low"})
        assert effort.status_code == 400 and effort.json()["error"]["param"] == "reasoning_effort"


def test_reasoning_effort_reaches_a_template_that_reads_it(server):
    assert "effort: high" in _rendered(server, {"model": MODEL, "messages": HISTORY[:1],
                                                "chat_template_kwargs": {"reasoning_effort": "high"}})
    ok = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": HISTORY[:1], "max_tokens": 2,
                                                "reasoning_effort": "high"})
    assert ok.status_code == 200


def test_tokenize_round_trips_through_detokenize(server):
    text = "ROMEO: But, soft! what light — café 🙂"
    out = _post(server, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False,
                                      "return_token_strs": True}).json()
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == server.engine.model_info.max_model_len
    assert len(out["token_strs"]) == out["count"]
    assert _post(server, "/detokenize", {"model": MODEL, "tokens": out["tokens"]}).json() == {"prompt": text}
    with_bos = _post(server, "/tokenize", {"prompt": text}).json()
    assert with_bos["tokens"][1:] == out["tokens"] and with_bos["token_strs"] is None
    chat = _post(server, "/tokenize", {"model": MODEL, "messages": HISTORY[:1]}).json()
    usage = _post(server, "/v1/chat/completions", {"messages": HISTORY[:1], "max_tokens": 1}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    assert _post(server, "/detokenize", {"tokens": [10 ** 9]}).status_code == 400
    assert _post(server, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404


@pytest.mark.parametrize("fields, words", [
    ({"tool_call_parser": "nope"}, "--tool-call-parser 'nope'"),
    ({"reasoning_parser": "nope"}, "--reasoning-parser 'nope'"),
    ({"enable_auto_tool_choice": True}, "needs --tool-call-parser"),
])
def test_server_settings_check_the_tool_flags(fields, words):
    from llmctl.server.app import ServerSettings

    with pytest.raises(ValueError, match=words):
        ServerSettings(**fields).validate()


# ---- shapes: recorded outputs through the response layer -------------------------------------------
class _CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


TEXT = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>')


def _shapes(stream: bool):
    body = ChatCompletionRequest.model_validate({"messages": HISTORY[:1], "tools": TOOLS, "stream": stream})
    params = engine_params(body, [Prompt(None, [1])], ServerLimits(4096, 1024, 256, 8),
                           ChatOutputSpec(reasoning_parser="qwen3", tool_parser="hermes"))
    return shapes_for(params, TokenTexts(_CharTokenizer()), [Prompt(None, [1])], "x", MODEL)


def test_tool_calls_and_reasoning_in_a_body_validate_as_openai_types():
    from openai.types.chat import ChatCompletion

    final = RequestOutput("x", None, [1], [CompletionOutput(0, TEXT, [ord(c) for c in TEXT], None, None, "stop", None)],
                          True)
    body = _shapes(False).body({0: final}, {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert body["choices"][0]["message"]["reasoning_content"] == "\nThe user wants the weather.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls)


def test_streamed_tool_call_deltas_accumulate_as_the_openai_sdk_does():
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    shapes, state = _shapes(True), ChatCompletionStreamState()
    events = shapes.opening_chunks()
    for start in range(0, len(TEXT), 5):
        piece = TEXT[start:start + 5]
        reason = "stop" if start + 5 >= len(TEXT) else None
        events.append(shapes.chunk(0, CompletionOutput(0, piece, [ord(c) for c in piece], None, None, reason, None),
                                   start == 0, None))
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')]
    reasoning = "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in events)
    assert reasoning == "\nThe user wants the weather.\n"


# ---- real clients, unmodified: an agent loop (langchain-openai), litellm and instructor with tools ----
CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"],
        "additionalProperties": False}


def test_langchain_agent_loop_tool_call_then_tool_message_then_answer(server):
    """The first turn names the tool (the grammar forces a call), the tool's result goes back as a tool
    message, and the second turn (tool_choice none) answers in text."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """The weather in a city."""
        return f"18 C, sunny in {city}"

    chat = langchain_openai.ChatOpenAI(base_url=server.base_url + "/v1", api_key="none", model=MODEL, max_tokens=16,
                                       temperature=0, max_retries=0)
    messages = [HumanMessage("Weather in Paris?")]
    call = chat.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    (request,) = call.tool_calls
    assert request["name"] == "get_weather" and request["args"]["city"] in ("Oslo", "Paris")
    result = get_weather.invoke(request)  # a ToolMessage answering the call's id
    assert isinstance(result, ToolMessage) and result.tool_call_id == request["id"]
    answer = chat.bind_tools([get_weather], tool_choice="none").invoke(messages + [call, result])
    assert isinstance(answer, AIMessage) and not answer.tool_calls and isinstance(answer.content, str)
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


def test_litellm_with_a_named_tool_gets_a_call_whose_arguments_validate(server):
    litellm = pytest.importorskip("litellm")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    out = litellm.completion(model=f"openai/{MODEL}", api_base=server.base_url + "/v1", api_key="unused",
                             messages=HISTORY[:1], tools=tools, max_tokens=16, num_retries=0,
                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), CITY)


def test_instructor_tools_mode_returns_the_pydantic_model(server):
    instructor = pytest.importorskip("instructor", reason="instructor is in the test extra; not installed here")

    class Weather(pydantic.BaseModel):
        city: Literal["Oslo", "Paris"]

    client = instructor.from_openai(openai_client(server), mode=instructor.Mode.TOOLS)
    weather = client.chat.completions.create(model=MODEL, messages=HISTORY[:1], response_model=Weather,
                                             max_tokens=16, max_retries=0)
    assert isinstance(weather, Weather) and weather.city in ("Oslo", "Paris")
