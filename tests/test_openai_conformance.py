"""OpenAI conformance of `llmctl serve`, driven on a real loopback server with the official `openai`
client (and raw JSON where a client would hide the detail), plus litellm and langchain-openai.

The nullable fields come from the openai SDK's own request types (generated from OpenAI's spec), so
a field the spec adds or makes nullable shows up here without editing a list.
"""

from __future__ import annotations

import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from server_helpers import running_server

MODEL = "conf"
USER = [{"role": "user", "content": "Speak!"}]


@pytest.fixture(scope="module")
def server():
    with running_server(served_model_name=MODEL, max_output_tokens=64) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def _nullable_fields(params_type) -> list[str]:
    """The fields the SDK (so the spec) types as nullable: their annotation admits None."""
    hints = typing.get_type_hints(params_type)
    nullable = []
    for name, hint in hints.items():
        while typing.get_origin(hint) in (typing.Required, typing.NotRequired):
            hint = typing.get_args(hint)[0]
        if type(None) in typing.get_args(hint):
            nullable.append(name)
    return sorted(nullable)


COMPLETION_NULLABLE = _nullable_fields(completion_create_params.CompletionCreateParamsBase) + ["stream"]
CHAT_NULLABLE = _nullable_fields(chat_create_params.CompletionCreateParamsBase) + ["stream"]


def test_the_spec_tables_hold_the_fields_the_issue_names():
    assert {"n", "stream", "presence_penalty", "frequency_penalty", "echo", "prompt"} <= set(COMPLETION_NULLABLE)
    assert {"n", "stream", "presence_penalty", "frequency_penalty", "logprobs"} <= set(CHAT_NULLABLE)


# ---- point 2: explicit null means the default ---------------------------------------------------
@pytest.mark.parametrize("field", COMPLETION_NULLABLE)
def test_completion_accepts_null_for_every_nullable_field(server, field):
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 3, field: None}
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("field", CHAT_NULLABLE)
def test_chat_accepts_null_for_every_nullable_field(server, field):
    body = {"model": MODEL, "messages": USER, "max_tokens": 3, field: None}
    response = _post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_openai_client_sending_none_for_all_nullable_fields(client):
    nulls = {name: None for name in COMPLETION_NULLABLE if name not in ("prompt", "max_tokens")}
    out = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=4, **nulls)
    assert len(out.choices) == 1 and out.choices[0].logprobs is None
    chat_nulls = {name: None for name in CHAT_NULLABLE if name not in ("max_tokens",)}
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, **chat_nulls)
    assert chat.choices[0].message.content is not None and chat.choices[0].logprobs is None


def test_null_prompt_generates_from_the_start_of_a_document(server):
    response = _post(server, "/v1/completions", {"model": MODEL, "prompt": None, "max_tokens": 5,
                                                 "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}


def test_replayed_assistant_message_with_null_fields_is_accepted(client):
    first = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    replay = first.choices[0].message.model_dump()  # role, content, refusal, tool_calls, audio, ... as None
    assert "refusal" in replay and replay["refusal"] is None
    again = client.chat.completions.create(model=MODEL, messages=[*USER, replay, *USER], max_tokens=4)
    assert again.choices[0].message.role == "assistant"


def test_null_does_not_hide_a_required_field(server):
    response = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": None})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


# ---- point 4: unsupported and unknown fields are refused, naming them -----------------------------
UNSUPPORTED = [
    ("/v1/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "guided_regex", "[a-z]+"),
    ("/v1/completions", "guided_choice", ["yes", "no"]),
    ("/v1/completions", "guided_grammar", "root ::= 'a'"),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "allowed_token_ids", [1, 2]),
    ("/v1/completions", "bad_words", ["x"]),
    ("/v1/completions", "truncate_prompt_tokens", 4),
    ("/v1/completions", "structured_outputs", {"json": {}}),
    ("/v1/completions", "prompt_embeds", "AAAA"),
    ("/v1/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "guided_json", {"type": "object"}),
    ("/v1/chat/completions", "response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "auto"),
    ("/v1/chat/completions", "parallel_tool_calls", True),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", "reasoning_effort", "low"),
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/chat/completions", "store", True),
    ("/v1/chat/completions", "service_tier", "flex"),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"),
    ("/v1/chat/completions", "continue_final_message", True),
]


def _base(path: str) -> dict:
    return {"model": MODEL, "max_tokens": 2, **({"prompt": "ROMEO:"} if path == "/v1/completions"
                                               else {"messages": USER})}


@pytest.mark.parametrize("path, field, value", UNSUPPORTED, ids=[f"{p[4:]}-{f}" for p, f, _ in UNSUPPORTED])
def test_known_but_unsupported_fields_are_refused_by_name(server, path, field, value):
    response = _post(server, path, {**_base(path), field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"] and error["type"] == "invalid_request_error"
    assert _post(server, path, {**_base(path), field: None}).status_code == 200


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "store", False), ("/v1/chat/completions", "tool_choice", "none"),
    ("/v1/chat/completions", "modalities", ["text"]), ("/v1/chat/completions", "service_tier", "auto"),
    ("/v1/chat/completions", "tools", []), ("/v1/completions", "response_format", {"type": "text"}),
    ("/v1/completions", "use_beam_search", False), ("/v1/chat/completions", "metadata", {"k": "v"}),
    ("/v1/chat/completions", "safety_identifier", "user-1"), ("/v1/chat/completions", "prompt_cache_key", "k"),
])
def test_values_that_switch_a_feature_off_are_accepted(server, path, field, value):
    assert _post(server, path, {**_base(path), field: value}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_refused_as_openai_does(server, path):
    response = _post(server, path, {**_base(path), "temprature": 0.5, "frobnicate": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == "Unrecognized request arguments supplied: temprature, frobnicate"
    assert error["param"] == "temprature" and error["type"] == "invalid_request_error"


def test_unknown_field_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: guided_jsn"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"guided_jsn": {}})


def test_assistant_tool_calls_in_history_are_refused(server):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    response = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert response.status_code == 400 and "tool_calls" in response.json()["error"]["message"]


# ---- point 3: routes -------------------------------------------------------------------------------
def test_models_retrieve_and_list(client):
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL] and listed[0].created > 1_600_000_000
    one = client.models.retrieve(MODEL)
    assert one.id == MODEL and one.object == "model" and one.created == listed[0].created
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-9")
    assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"


def test_head_health(server):
    response = httpx.head(server.base_url + "/health", timeout=10)
    assert response.status_code == 200 and response.content == b""


# ---- point 12: response fields OpenAI sends ----------------------------------------------------------
def test_bodies_and_chunks_carry_system_fingerprint_and_refusal(server):
    whole = _post(server, "/v1/completions", {**_base("/v1/completions")}).json()
    assert "system_fingerprint" in whole and whole["system_fingerprint"] is None
    chat = _post(server, "/v1/chat/completions", {**_base("/v1/chat/completions")}).json()
    assert chat["system_fingerprint"] is None and "refusal" in chat["choices"][0]["message"]
    assert chat["choices"][0]["message"]["refusal"] is None
    for path in ("/v1/completions", "/v1/chat/completions"):
        with httpx.stream("POST", server.base_url + path, timeout=60,
                          json={**_base(path), "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        assert events and all('"system_fingerprint": null' in event for event in events)
    first_chat_chunk = events[0]
    assert '"refusal": null' in first_chat_chunk


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_stream_is_refused(server, path, stream):
    body = {**_base(path), "stream_options": {"include_usage": True}}
    if stream is not None:
        body["stream"] = stream
    response = _post(server, path, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"
    assert _post(server, path, {**_base(path), "stream": False, "stream_options": None}).status_code == 200


# ---- the official client over every endpoint -------------------------------------------------------
def test_openai_client_over_the_documented_completion_fields(client):
    out = client.completions.create(model=MODEL, prompt=["ROMEO:", [5, 6, 7]], max_tokens=4, n=2, temperature=0.5,
                                    top_p=0.9, seed=3, stop=["\n\n"], presence_penalty=0.1, frequency_penalty=0.1,
                                    logit_bias={"5": -1}, user="u", echo=False, best_of=2, logprobs=1,
                                    extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1,
                                                "min_tokens": 1, "stop_token_ids": [3], "priority": 0,
                                                "include_stop_str_in_output": False, "skip_special_tokens": True,
                                                "ignore_eos": False})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(len(c.logprobs.tokens) >= 1 for c in out.choices)
    streamed = list(client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=4, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.completion_tokens >= 1 and streamed[-1].system_fingerprint is None


def test_openai_client_over_the_documented_chat_fields(client):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "system", "content": "You are a player."},
                {"role": "user", "content": [{"type": "text", "text": "Speak"}, {"type": "text", "text": "!"}],
                 "name": "alice"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4, n=2,
                                         temperature=0.5, top_p=0.9, seed=3, stop="\n\n", logprobs=True,
                                         top_logprobs=2, presence_penalty=0.1, frequency_penalty=0.1,
                                         logit_bias={"5": -1}, user="u", response_format={"type": "text"},
                                         metadata={"run": "1"}, store=False, tool_choice="none",
                                         modalities=["text"], service_tier="auto", safety_identifier="s",
                                         prompt_cache_key="k", prompt_cache_retention="in_memory")
    assert [c.index for c in out.choices] == [0, 1] and out.system_fingerprint is None
    assert all(c.message.refusal is None and len(c.logprobs.content) >= 1 for c in out.choices)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens >= 1


# ---- other clients -------------------------------------------------------------------------------
def test_litellm_completion_and_chat(server):
    litellm = pytest.importorskip("litellm", reason="litellm is in the test extra; not installed here")
    common = dict(api_base=server.base_url + "/v1", api_key="none", max_tokens=4, temperature=0)
    chat = litellm.completion(model=f"openai/{MODEL}", messages=USER, **common)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    streamed = list(litellm.completion(model=f"openai/{MODEL}", messages=USER, stream=True, **common))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    text = litellm.text_completion(model=f"text-completion-openai/{MODEL}", prompt="ROMEO:", **common)
    assert text.choices[0].text is not None and text.usage.completion_tokens >= 1


def test_langchain_openai_chat_and_llm(server):
    langchain_openai = pytest.importorskip("langchain_openai",
                                           reason="langchain-openai is in the test extra; not installed here")
    common = dict(base_url=server.base_url + "/v1", api_key="none", model=MODEL, max_tokens=4, temperature=0,
                  max_retries=0)
    chat = langchain_openai.ChatOpenAI(**common)
    reply = chat.invoke("Speak!")
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    assert "".join(chunk.content for chunk in chat.stream("Speak!")) == reply.content
    llm = langchain_openai.OpenAI(**common)
    assert isinstance(llm.invoke("ROMEO:"), str)
