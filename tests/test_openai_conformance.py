"""OpenAI conformance of `llmctl serve`, driven on a real loopback server with the official `openai`
client (and raw JSON where a client would hide the detail), plus litellm and langchain-openai.

The nullable fields come from the openai SDK's own request types (generated from OpenAI's spec), so
a field the spec adds or makes nullable shows up here without editing a list.
"""

from __future__ import annotations

import json
import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from server_helpers import running_server, openai_client, post_json

MODEL = "conf"
USER = [{"role": "user", "content": "Speak!"}]


@pytest.fixture(scope="module")
def server():
    with running_server(served_model_name=MODEL, max_output_tokens=64) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


_post = post_json


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
    ("/v1/completions", "guided_decoding_backend", "outlines"),
    ("/v1/chat/completions", "structural_tag", {"type": "structural_tag"}),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "allowed_token_ids", [1, 2]),
    ("/v1/completions", "bad_words", ["x"]),
    ("/v1/completions", "truncate_prompt_tokens", 4),
    ("/v1/completions", "prompt_embeds", "AAAA"),
    ("/v1/chat/completions", "tool_choice", "auto"),  # without tools
    ("/v1/chat/completions", "parallel_tool_calls", False),
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
    ("/v1/chat/completions", "add_special_tokens", True),
    ("/v1/chat/completions", "truncate_prompt_tokens", 8),
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


def test_assistant_tool_calls_in_history_are_accepted_and_function_call_refused(server):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    assert _post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages}).status_code == 200
    legacy = [*USER, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]
    response = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": legacy})
    assert response.status_code == 400 and "function_call" in response.json()["error"]["message"]


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
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 6}),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 6}),
])
def test_guidellm_streaming_body_with_continuous_usage(server, path, body):
    """guidellm 0.8's OpenAI backend (backends/openai/request_handlers.py) streams with
    stream_options {include_usage, continuous_usage_stats} (vLLM's) and stop: null, ignore_eos.
    guidellm itself is not installed: it would downgrade click and multidict under the CLI."""
    request = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
               "stop": None, "ignore_eos": True, **body}
    with httpx.stream("POST", server.base_url + path, json=request, timeout=60) as response:
        assert response.status_code == 200, response.read()
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    counts = [event["usage"]["completion_tokens"] for event in events]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(event["usage"]["prompt_tokens"] > 0 for event in events)
    assert events[-1]["choices"] == []
    # Every chunk with text carries the tokens so far. How many chunks there are is not fixed: a reader that
    # falls behind the engine gets the tokens not yet read in one chunk (RequestStream), all 6 on a loaded host.
    texts = [(event["choices"][0].get("text") or event["choices"][0].get("delta", {}).get("content"))
             if event["choices"] else None for event in events]
    with_text = [event["usage"]["completion_tokens"] for event, text in zip(events, texts) if text]
    assert with_text and with_text[0] > 0 and with_text == sorted(set(with_text))


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


# ---- point 1: echo + logprobs score the prompt; vLLM's prompt_logprobs; lm-eval's loglikelihood ----
SCORED_TEXT = "ROMEO: But, soft! what light through yonder window breaks?"


@pytest.fixture(scope="module")
def tiny_server(tiny_chat_model):
    with running_server(tiny_chat_model, engine_options={"dtype": "float32"}, served_model_name="tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny_client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_chat_model):
    """Token log-probabilities from transformers itself, in fp32: ids -> [None, lp(ids[1] | ids[:1]), ...]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()

    def score(ids: list[int]) -> tuple[list, "torch.Tensor"]:
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        return [None] + [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))], logprobs

    return score


def _prompt_ids(tiny_server, text: str) -> list[int]:
    return tiny_server.engine.model_info.tokenizer.encode(text)


def _assert_close(ours: list, expected: list, tol: float = 1e-4) -> None:
    assert len(ours) == len(expected)
    assert ours[0] is None and expected[0] is None
    assert max(abs(a - b) for a, b in zip(ours[1:], expected[1:])) < tol


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(tiny_client, tiny_server, reference):
    ids = _prompt_ids(tiny_server, SCORED_TEXT)
    out = tiny_client.completions.create(model="tiny", prompt=SCORED_TEXT, echo=True, logprobs=2, max_tokens=0,
                                         temperature=0)
    choice = out.choices[0]
    assert choice.text == SCORED_TEXT and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    lp = choice.logprobs
    expected, full = reference(ids)
    _assert_close(lp.token_logprobs, expected)
    assert lp.top_logprobs[0] is None and all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    best = full.argmax(dim=-1).tolist()
    assert all(max(top.values()) == pytest.approx(full[i - 1, best[i - 1]].item(), abs=1e-4)
               for i, top in enumerate(lp.top_logprobs) if i)
    assert lp.tokens == [tiny_server.engine.model_info.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    # text_offset indexes the echoed text: the BOS token has no text, each other token starts where its text does
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    pieces = [choice.text[a:b] for a, b in zip(lp.text_offset, lp.text_offset[1:] + [len(choice.text)])]
    assert pieces[1:] == lp.tokens[1:] and pieces[0] == ""
    tiny_server.wait_idle()


def test_echo_then_generated_tokens_continue_the_lists(tiny_client, tiny_server, reference):
    ids = _prompt_ids(tiny_server, SCORED_TEXT)
    out = tiny_client.completions.create(model="tiny", prompt=SCORED_TEXT, echo=True, logprobs=1, max_tokens=4,
                                         temperature=0, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 4 and out.usage.completion_tokens == 4
    _assert_close(lp.token_logprobs[: len(ids)], reference(ids)[0])
    generated = out.choices[0].text[len(SCORED_TEXT):]
    assert "".join(lp.tokens[len(ids):]) == generated
    assert lp.text_offset[len(ids)] == len(SCORED_TEXT)
    assert all(lp.token_logprobs[i] == max(lp.top_logprobs[i].values()) for i in range(len(ids), len(lp.tokens)))
    streamed = list(tiny_client.completions.create(model="tiny", prompt=SCORED_TEXT, echo=True, logprobs=1,
                                                   max_tokens=4, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [v for c in streamed for v in getattr(c.choices[0].logprobs, key)] == getattr(lp, key)
    tiny_server.wait_idle()


def test_token_id_prompts_and_n_get_echo_logprobs_per_choice(tiny_client, tiny_server, reference):
    ids = [0, 17, 33, 101, 250, 7, 300]
    out = tiny_client.completions.create(model="tiny", prompt=[ids, ids[:4]], echo=True, logprobs=0, max_tokens=0,
                                         n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice, prompt in zip(out.choices, [ids, ids, ids[:4], ids[:4]]):
        _assert_close(choice.logprobs.token_logprobs, reference(prompt)[0])


def test_vllm_prompt_logprobs_with_exact_ranks(tiny_server, reference):
    ids = _prompt_ids(tiny_server, SCORED_TEXT)
    body = {"model": "tiny", "prompt": SCORED_TEXT, "max_tokens": 1, "prompt_logprobs": 3, "temperature": 0}
    response = httpx.post(tiny_server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["logprobs"] is None and choice["text"] != SCORED_TEXT
    scored = choice["prompt_logprobs"]
    expected, full = reference(ids)
    assert len(scored) == len(ids) and scored[0] is None
    for i in range(1, len(ids)):
        entry = scored[i]
        assert abs(entry[str(ids[i])]["logprob"] - expected[i]) < 1e-4
        order = full[i - 1].argsort(descending=True).tolist()
        for token, item in entry.items():
            true_rank = order.index(int(token)) + 1
            assert item["rank"] == (true_rank if true_rank <= 3 else None)
            assert abs(item["logprob"] - full[i - 1, int(token)].item()) < 1e-4
        assert {int(t) for t in entry} == set(order[:3]) | {ids[i]}


def test_chat_prompt_logprobs_score_the_rendered_conversation(tiny_server, reference):
    body = {"model": "tiny", "messages": USER, "max_tokens": 1, "prompt_logprobs": 1}
    response = httpx.post(tiny_server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    ids = tiny_server.engine.model_info.tokenizer.encode_chat(USER, True)
    scored = response.json()["prompt_logprobs"]
    assert len(scored) == len(ids) == response.json()["usage"]["prompt_tokens"]
    _assert_close([None if e is None else e[str(t)]["logprob"] for e, t in zip(scored, ids)], reference(ids)[0])


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 99}, "prompt_logprobs"),
])
def test_scoring_requests_that_are_refused(tiny_server, body, param):
    response = httpx.post(tiny_server.base_url + "/v1/completions", json={"prompt": "x", **body}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_lm_eval_loglikelihood_request_reproduced_exactly(tiny_client, tiny_server, reference):
    """lm-eval 0.4's `local-completions` scoring call and parse (lm_eval/models/openai_completions.py):
    token-id prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234, then
    sum(token_logprobs[ctxlen:-1]) and greedy = every token equals its top candidate."""
    tokenizer = tiny_server.engine.model_info.tokenizer
    context = tokenizer.encode("ROMEO: But, soft! what light")
    continuations = [tokenizer.encode(text, add_special_tokens=False) for text in (" through", " is the")]
    prompts = [context + c for c in continuations]
    out = tiny_client.completions.create(model="tiny", prompt=prompts, temperature=0, max_tokens=1, logprobs=1,
                                         seed=1234, echo=True)
    for choice, prompt, continuation in zip(sorted(out.choices, key=lambda c: c.index), prompts, continuations):
        ctxlen = len(context)
        logprob = sum(choice.logprobs.token_logprobs[ctxlen:-1])
        expected, full = reference(prompt)
        assert len(choice.logprobs.token_logprobs[ctxlen:-1]) == len(continuation)
        assert abs(logprob - sum(expected[ctxlen:])) < 1e-4
        greedy = all(tok == max(top.values()) for tok, top in zip(choice.logprobs.token_logprobs[ctxlen:-1],
                                                                   choice.logprobs.top_logprobs[ctxlen:-1]))
        assert greedy == all(full[i - 1].argmax().item() == prompt[i] for i in range(ctxlen, len(prompt)))


MC_DOCS = [{"question": "To be, or not to be, that is the", "choices": ["question", "answer", "sun"], "answer": 0},
           {"question": "ROMEO: But, soft! what light through yonder", "choices": ["window", "door"], "answer": 0},
           {"question": "Juliet is the", "choices": ["sun", "moon", "east"], "answer": 2},
           {"question": "The slings and arrows of outrageous", "choices": ["fortune", "troubles"], "answer": 0}]


def _write_mc_task(folder) -> str:
    """A multiple-choice task read from a local JSON-lines file (no hub), scored with `acc`."""
    import json

    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in MC_DOCS))
    (folder / "tiny_mc.yaml").write_text(
        "task: llmctl_tiny_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {folder / 'hf-cache'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return "llmctl_tiny_mc"


@pytest.mark.slow
def test_lm_eval_multiple_choice_task_scores_like_transformers(tiny_server, tiny_chat_model, reference, tmp_path,
                                                              monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra; not installed here")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    task = _write_mc_task(tmp_path)
    lm = LocalCompletionsAPI(base_url=tiny_server.base_url + "/v1/completions", model="tiny",
                             tokenizer_backend="huggingface", tokenizer=str(tiny_chat_model), num_concurrent=1,
                             max_retries=1)
    results = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=TaskManager(include_path=str(tmp_path)),
                                      log_samples=True)
    correct = 0
    for sample in results["samples"][task]:
        scores = [resp[0][0] for resp in sample["resps"]]
        expected = []
        for context, continuation in sample["arguments"]:
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            token_logprobs, _ = reference(context_ids + continuation_ids)
            expected.append(sum(token_logprobs[len(context_ids):]))
        assert scores == pytest.approx(expected, abs=1e-3), sample["arguments"]
        assert all(score < 0 for score in scores)  # before the fix every choice scored exactly 0
        correct += max(range(len(expected)), key=expected.__getitem__) == sample["target"]
    assert results["results"][task]["acc,none"] == pytest.approx(correct / len(MC_DOCS))
    tiny_server.wait_idle()


# ---- vLLM extras that are implemented --------------------------------------------------------------
@pytest.fixture(scope="module")
def thinking_model(tiny_chat_model, tmp_path_factory):
    """The tiny chat model with a Qwen3-style template that reads `enable_thinking`."""
    import json
    import shutil

    folder = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_chat_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                               "<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
                               "<think></think>{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_chat_template_kwargs_reach_the_template(thinking_model):
    with running_server(thinking_model, served_model_name="t") as srv:
        def prompt_tokens(**extra) -> int:
            response = _post(srv, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, **extra})
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens"]

        plain = prompt_tokens()
        no_think = prompt_tokens(chat_template_kwargs={"enable_thinking": False})
        expected = len(srv.engine.model_info.tokenizer.encode("<think></think>", add_special_tokens=False))
        assert no_think == plain + expected
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain
        for key in ("messages", "tools", "bos_token"):
            refused = _post(srv, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {key: 1}})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


def test_completions_add_special_tokens(tiny_server):
    """The tiny tokenizer prepends BOS to text; vLLM's add_special_tokens: false leaves it out."""
    body = {"prompt": "ROMEO:", "max_tokens": 0, "echo": True, "logprobs": 0}
    with_bos = _post(tiny_server, "/v1/completions", body).json()["choices"][0]["logprobs"]["tokens"]
    without = _post(tiny_server, "/v1/completions", {**body, "add_special_tokens": False}).json()
    assert with_bos[0] == "<s>" and without["choices"][0]["logprobs"]["tokens"] == with_bos[1:]
