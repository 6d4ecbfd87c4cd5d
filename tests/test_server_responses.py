"""The server's request translation (`protocol.engine_params`) and response shapes (`responses`),
without a server or a model: bodies in, `EngineParams` out; engine outputs in, OpenAI JSON out."""

from __future__ import annotations

import dataclasses
import json

import pytest

from llmctl.engine.outputs import CompletionOutput, RequestOutput
from llmctl.engine.sampling_params import RequestOutputKind
from llmctl.server.errors import APIError
from llmctl.server.protocol import (ChatCompletionRequest, CompletionRequest, Prompt, ServerLimits,
                                    engine_params)
from llmctl.server.responses import SSE_DONE, TokenTexts, shapes_for, sse

LIMITS = ServerLimits(max_model_len=64, max_output_tokens=32, vocab_size=8, max_sequences_per_request=32)
VOCAB = ["<s>", "Ro", "meo", ":", " I", " am", "é", "!"]
MESSAGES = [{"role": "user", "content": "Hi"}]


class CharTokenizer:
    """Each id one fixed piece of text (enough for TokenTexts and the incremental detokenizer)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == 0))


TEXTS = TokenTexts(CharTokenizer())


def completion(fields: dict, prompts: list[Prompt]):
    return engine_params(CompletionRequest.model_validate({"prompt": "x", **fields}), prompts, LIMITS)


def chat(fields: dict, prompt: Prompt):
    return engine_params(ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields}), [prompt], LIMITS)


def delta(index: int, ids: list[int], entries=None, reason=None, stop_reason=None) -> CompletionOutput:
    return CompletionOutput(index, "".join(VOCAB[i] for i in ids), ids, None, entries, reason, stop_reason)


def entry(chosen: int, logprob: float, **others: float) -> dict[int, float]:
    """A logprob entry: the chosen token and other candidates (named t<id>)."""
    return {chosen: logprob, **{int(name[1:]): lp for name, lp in others.items()}}


PROMPT = Prompt("Romeo:", [1, 2, 3])


# ---- engine_params ------------------------------------------------------------------------------------
def test_one_sampling_params_per_prompt_each_checked_against_its_prompts_length():
    assert chat({}, Prompt(None, [1] * 40)).sampling[0].max_tokens == 24  # the room left, under the 32 cap
    assert chat({}, Prompt(None, [1] * 10)).sampling[0].max_tokens == 32
    with pytest.raises(APIError, match="maximum context length is 64 tokens") as caught:
        completion({"max_tokens": 30}, [Prompt(None, [1] * 10), Prompt(None, [1] * 40)])
    assert caught.value.param == "max_tokens"
    params = completion({"max_tokens": 30, "n": 2, "priority": 3}, [Prompt(None, [1] * 10), Prompt(None, [1] * 20)])
    assert [sp.max_tokens for sp in params.sampling] == [30, 30]
    assert (params.n, params.priority, params.chat, params.stream) == (2, 3, False, False)
    assert all(sp.output_kind is RequestOutputKind.FINAL_ONLY for sp in params.sampling)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.n = 3  # type: ignore[misc]


def test_chat_logprobs_become_one_width_and_top_logprobs_alone_is_refused():
    assert chat({}, PROMPT).logprobs is None
    assert chat({"logprobs": True}, PROMPT).logprobs == 0
    params = chat({"logprobs": True, "top_logprobs": 3}, PROMPT)
    assert params.logprobs == params.sampling[0].logprobs == 3
    with pytest.raises(APIError, match="top_logprobs needs logprobs: true"):
        chat({"top_logprobs": 3}, PROMPT)


def test_echo_scoring_and_prompt_logprobs_widths():
    scoring = completion({"echo": True, "max_tokens": 0, "logprobs": 2}, [PROMPT])
    assert scoring.scores_prompt_only and scoring.echo
    assert scoring.sampling[0].max_tokens == 1  # one token is sampled, then dropped
    both = completion({"echo": True, "logprobs": 2, "prompt_logprobs": 5}, [PROMPT])
    assert (both.logprobs, both.prompt_logprobs, both.prompt_logprobs_width) == (2, 5, 5)
    assert both.sampling[0].prompt_logprobs == 5
    assert completion({"logprobs": 2}, [PROMPT]).prompt_logprobs_width is None  # no echo: no prompt scoring


def test_stream_options_translate_to_usage_flags():
    plain = completion({"stream": True}, [PROMPT])
    assert (plain.stream, plain.include_usage, plain.continuous_usage) == (True, False, False)
    assert plain.sampling[0].output_kind is RequestOutputKind.DELTA
    usage = completion({"stream": True, "stream_options": {"include_usage": True}}, [PROMPT])
    assert (usage.include_usage, usage.continuous_usage) == (True, False)
    every = completion({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                       [PROMPT])
    assert (every.include_usage, every.continuous_usage) == (True, True)


@pytest.mark.parametrize("fields, num_prompts, message", [
    ({"n": 17, "max_tokens": 1000}, 2, "asks for 34 sequences"),  # the fan-out is checked first
    ({"n": 17, "max_tokens": 1000}, 1, "max_tokens 1000 exceeds"),  # then each prompt's max_tokens
    ({"n": 17}, 1, "n must be between 1 and 16"),
    ({"stop": ["x"] * 17}, 1, "at most 16 stop sequences"),
])
def test_the_first_refused_field_is_named(fields, num_prompts, message):
    with pytest.raises(APIError, match=message):
        completion(fields, [PROMPT] * num_prompts)


def test_an_api_keys_cap_lowers_the_default_max_tokens():
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES})
    body.limit_max_tokens(5)
    assert engine_params(body, [PROMPT], LIMITS).sampling[0].max_tokens == 5


# ---- chat shapes --------------------------------------------------------------------------------------
def test_a_chat_stream_opens_with_a_role_chunk_per_choice_then_content_and_logprobs():
    params = chat({"n": 2, "stream": True, "logprobs": True, "top_logprobs": 1}, PROMPT)
    shapes = shapes_for(params, TEXTS, [PROMPT], "abc", "m")
    opening = shapes.opening_chunks()
    assert [c["choices"] for c in opening] == [
        [{"index": i, "delta": {"role": "assistant", "content": "", "refusal": None}, "logprobs": None,
          "finish_reason": None}] for i in range(2)]
    chunk = shapes.chunk(0, delta(1, [6], [entry(6, -0.5, t7=-0.25, t4=-3.0)]), True, None)
    assert {k: chunk[k] for k in ("id", "object", "model", "system_fingerprint")} == {
        "id": "chatcmpl-abc", "object": "chat.completion.chunk", "model": "m", "system_fingerprint": None}
    assert chunk["choices"] == [{
        "index": 1, "delta": {"content": "é"}, "finish_reason": None,
        "logprobs": {"content": [{"token": "é", "logprob": -0.5, "bytes": [195, 169],
                                  "top_logprobs": [{"token": "!", "logprob": -0.25, "bytes": [33]}]}]}}]
    last = shapes.chunk(0, delta(1, [], [], reason="stop"), False, None)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert "stop_reason" not in last["choices"][0]


def test_stream_usage_is_null_in_chunks_then_a_closing_chunk_or_in_every_chunk():
    counts = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    plain = shapes_for(chat({"stream": True}, PROMPT), TEXTS, [PROMPT], "a", "m")
    assert "usage" not in json.loads(plain.stream_event({"x": 1}, lambda: counts)[6:])
    assert plain.usage_event(counts) is None
    closing = shapes_for(chat({"stream": True, "stream_options": {"include_usage": True}}, PROMPT), TEXTS,
                         [PROMPT], "a", "m")
    assert json.loads(closing.stream_event({"x": 1}, lambda: counts)[6:]) == {"x": 1, "usage": None}
    last = json.loads(closing.usage_event(counts)[6:])
    assert (last["object"], last["choices"], last["usage"]) == ("chat.completion.chunk", [], counts)
    every = shapes_for(chat({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                            PROMPT), TEXTS, [PROMPT], "a", "m")
    assert json.loads(every.stream_event({"x": 1}, lambda: counts)[6:])["usage"] == counts
    assert sse({"t": "é"}) == 'data: {"t": "é"}\n\n' and SSE_DONE == "data: [DONE]\n\n"


def test_a_chat_body_has_messages_and_vllm_prompt_logprobs_beside_the_choices():
    params = chat({"prompt_logprobs": 1}, PROMPT)
    final = RequestOutput("r", None, PROMPT.token_ids, [delta(0, [4, 5], reason="length")], True,
                          prompt_logprobs=[None, entry(2, -0.5), entry(3, -4.0, t5=-0.1)])
    counts = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    body = shapes_for(params, TEXTS, [PROMPT], "id", "m").body({0: final}, counts)
    assert body["object"] == "chat.completion" and body["usage"] == counts
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": " I am", "refusal": None},
                                "logprobs": None, "finish_reason": "length", "stop_reason": None}]
    assert body["prompt_logprobs"] == [
        None,
        {"2": {"logprob": -0.5, "rank": 1, "decoded_token": "meo"}},
        # the prompt token 3 was outside the engine's top 1 (width 1): kept, but unranked
        {"5": {"logprob": -0.1, "rank": 1, "decoded_token": " am"}, "3": {"logprob": -4.0, "rank": None,
                                                                        "decoded_token": ":"}},
    ]


# ---- completion shapes --------------------------------------------------------------------------------
PROMPT_LOGPROBS = [None, entry(2, -1.0, t3=-0.5), entry(3, -0.2)]
DELTAS = [delta(0, [4], [entry(4, -0.1, t5=-2.0)]), delta(0, [6, 7], [entry(6, -0.3), entry(7, -0.4)], "stop", "\n")]


def test_completion_chunks_echo_the_prompt_once_and_continue_its_text_offsets():
    params = completion({"echo": True, "logprobs": 1, "stream": True, "max_tokens": 4}, [PROMPT])
    shapes = shapes_for(params, TEXTS, [PROMPT], "id", "m")
    first = shapes.chunk(0, DELTAS[0], True, PROMPT_LOGPROBS)["choices"][0]
    assert first["text"] == "Romeo: I" and first["finish_reason"] is None and first["stop_reason"] is None
    assert first["logprobs"] == {
        "tokens": ["Ro", "meo", ":", " I"], "token_logprobs": [None, -1.0, -0.2, -0.1],
        "top_logprobs": [None, {":": -0.5, "meo": -1.0}, {":": -0.2}, {" I": -0.1, " am": -2.0}],
        "text_offset": [0, 2, 5, 6]}
    second = shapes.chunk(0, DELTAS[1], False, PROMPT_LOGPROBS)["choices"][0]
    assert second["text"] == "é!" and (second["finish_reason"], second["stop_reason"]) == ("stop", "\n")
    assert second["logprobs"]["text_offset"] == [8, 9] and second["logprobs"]["tokens"] == ["é", "!"]


def test_completion_chunks_join_into_the_whole_body():
    fields = {"echo": True, "logprobs": 1, "max_tokens": 4, "n": 2}
    prompts = [PROMPT, Prompt(None, [1, 3])]
    streamed = shapes_for(completion({**fields, "stream": True}, prompts), TEXTS, prompts, "id", "m")
    chunks = [streamed.chunk(1, DELTAS[0], True, PROMPT_LOGPROBS[:2])["choices"][0],
              streamed.chunk(1, DELTAS[1], False, PROMPT_LOGPROBS[:2])["choices"][0]]
    assert {c["index"] for c in chunks} == {2}  # prompt 1's first completion, with n=2
    whole = dataclasses.replace(DELTAS[0], text=" Ié!", token_ids=[4, 6, 7],
                                logprobs=DELTAS[0].logprobs + DELTAS[1].logprobs, finish_reason="stop",
                                stop_reason="\n")
    finals = {p: RequestOutput("r", None, prompts[p].token_ids, [whole], True, prompt_logprobs=PROMPT_LOGPROBS[:2])
              for p in (0, 1)}
    body = shapes_for(completion(fields, prompts), TEXTS, prompts, "id", "m").body(finals, {})
    choice = body["choices"][1]
    assert (body["id"], body["object"], choice["index"]) == ("cmpl-id", "text_completion", 2)
    assert choice["text"] == "".join(c["text"] for c in chunks) == "Ro: Ié!"
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert choice["logprobs"][key] == chunks[0]["logprobs"][key] + chunks[1]["logprobs"][key]
    assert "prompt_logprobs" not in choice


def test_completion_without_logprobs_has_null_logprobs():
    params = completion({"max_tokens": 4}, [PROMPT])
    choice = shapes_for(params, TEXTS, [PROMPT], "id", "m").chunk(0, DELTAS[0], True, None)["choices"][0]
    assert choice == {"index": 0, "text": " I", "logprobs": None, "finish_reason": None, "stop_reason": None}
