"""`llmctl serve` against the official `openai` client on a real loopback uvicorn server:
completions and chat, streaming and not, n / stop / seed / logprobs, usage counts, and many
concurrent or disconnecting streams that must all leave the KV cache empty."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from server_helpers import running_server

MODEL = "shakespeare"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    audit = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    with running_server(served_model_name=MODEL, api_key=KEY, max_output_tokens=256, audit_log=audit) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_with_n_seed_logprobs_and_usage(client, server):
    out = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=8, n=2, seed=11, temperature=0.9,
                                    logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 16 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 16
    for choice in out.choices:
        assert choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert "".join(lp.tokens) == choice.text
        assert all(v <= 0.0 for v in lp.token_logprobs)
        assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    again = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=8, n=2, seed=11, temperature=0.9,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    server.wait_idle()


def test_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    word = next(w for w in full.split() if len(w) >= 3 and full.index(w) > 2)
    cut = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=24, temperature=0, stop=[word],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(word)]


def _stream_completion_text(client, **kwargs) -> tuple[str, list, object]:
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks, chunks[-1].usage


def test_streamed_completion_equals_non_streamed_for_the_same_seed(client):
    args = dict(model=MODEL, prompt="JULIET:", max_tokens=30, temperature=0.8, seed=1234, stop=["\n\n"])
    whole = client.completions.create(**args)
    text, chunks, usage = _stream_completion_text(client, **args)
    assert text == whole.choices[0].text
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streaming_and_not_agree_with_logprobs(client):
    messages = [{"role": "system", "content": "You are a player."}, {"role": "user", "content": "Speak!"}]
    args = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0.7, seed=5)
    whole = client.chat.completions.create(logprobs=True, top_logprobs=2, **args)
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert len(choice.logprobs.content) == whole.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 for item in choice.logprobs.content)
    assert "".join(item.token for item in choice.logprobs.content) == choice.message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_n_samples_stream_by_index(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3,
                                                 max_completion_tokens=6, seed=3, stream=True))
    texts = {i: "" for i in range(3)}
    reasons = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert set(reasons) == {0, 1, 2}
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3,
                                           max_completion_tokens=6, seed=3)
    assert [c.message.content for c in whole.choices] == [texts[i] for i in range(3)]


def test_batch_of_prompts_and_token_id_prompts(client):
    out = client.completions.create(model=MODEL, prompt=["ROMEO:", [5, 6, 7, 8]], max_tokens=4, n=2,
                                    extra_body={"ignore_eos": True}, echo=True)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text.startswith("ROMEO:")
    assert out.usage.completion_tokens == 16


def test_sixty_four_concurrent_streams_complete_with_exact_usage(server):
    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, int, str]:
        max_tokens = 4 + (i * 7) % 40
        body = {"model": MODEL, "prompt": "KING " * (1 + i % 9), "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0.8, "stream_options": {"include_usage": True}}
        usage, finish = None, None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                finish = choice["finish_reason"] or finish
        return max_tokens, usage["completion_tokens"], finish

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                     headers={"Authorization": f"Bearer {KEY}"},
                                     limits=httpx.Limits(max_connections=100)) as http:
            return await asyncio.gather(*[one(http, i) for i in range(64)])

    results = asyncio.run(main())
    assert all(asked == got and finish == "length" for asked, got, finish in results)
    server.wait_idle()


def test_clients_disconnecting_mid_stream_free_every_block(server):
    async def hang_up(http: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": f"Scene {i}. " * 20, "max_tokens": 250, "stream": True, "ignore_eos": True}
        seen = 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream
        return seen

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60,
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            return await asyncio.gather(*[hang_up(http, i) for i in range(12)])

    assert all(seen == 3 for seen in asyncio.run(main()))
    server.wait_idle()


def test_non_streaming_client_timeout_aborts_the_request(server):
    # 250 tokens take ~0.15 s on an idle host since the native decode step (0.3 s no longer timed out)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(10.0, read=0.02),
                   json={"model": MODEL, "prompt": "A long tale:", "max_tokens": 250, "ignore_eos": True})
    server.wait_idle()


def test_audit_log_has_one_line_per_request_without_prompts(client, server):
    client.completions.create(model=MODEL, prompt="SECRET PROMPT", max_tokens=3, user="alice",
                              extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 5  # the line is written once the response has been sent
    while True:
        lines = [json.loads(line) for line in server.settings.audit_log.read_text().splitlines()]
        if lines and lines[-1].get("user") == "alice" or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    last = lines[-1]
    assert last["path"] == "/v1/completions" and last["status"] == 200 and last["user"] == "alice"
    assert last["completion_tokens"] == 3 and last["prompt_tokens"] > 0 and last["latency_ms"] > 0
    assert last["model"] == MODEL and last["request_id"] and last["client"] == "127.0.0.1"
    assert "SECRET" not in server.settings.audit_log.read_text()


def test_stream_has_a_chunk_per_step_even_without_printable_text(client):
    # token 0 is a special token: skipped in the text, so every step adds tokens but no characters
    # A reader that keeps up gets one chunk per step; one that lags (a loaded machine) gets the steps
    # it missed merged into its next chunk, so count the tokens the chunks carry, not the chunks.
    chunks = list(client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=5, logit_bias={"0": 100},
                                            logprobs=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks and all(c.choices[0].text == "" for c in chunks)
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == 5
    assert chunks[-1].choices[0].finish_reason == "length"


def _success_and_generated(server) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(server.base_url + "/metrics", timeout=10).text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples["llmctl:request_success_total"], samples["llmctl:generation_tokens_total"]


def test_engine_deltas_stream_what_the_whole_body_holds(client, server, monkeypatch):
    # The server asks the engine for deltas when streaming and for the final output only otherwise;
    # two prompts, n=3, echo with logprobs and a stop string held back: the chunks add up to the body,
    # usage and the request metrics count every token and choice.
    from llmctl.engine import RequestOutputKind

    kinds = []
    submit = server.engine.add_request

    async def spy(request_id, prompt, params, **kwargs):
        kinds.append(params.output_kind)
        return await submit(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(server.engine, "add_request", spy)
    args = dict(model=MODEL, prompt=["ROMEO:", "JULIET:"], max_tokens=12, n=3, seed=9, temperature=0.9, logprobs=2,
                echo=True, extra_body={"ignore_eos": True})
    free = client.completions.create(**args)
    stop = free.choices[1].text[len("ROMEO:") + 4:][:2]
    whole = client.completions.create(**args, stop=[stop])
    assert kinds == [RequestOutputKind.FINAL_ONLY] * 4
    before = _success_and_generated(server)
    chunks = list(client.completions.create(**args, stop=[stop], stream=True, stream_options={"include_usage": True}))
    assert kinds[4:] == [RequestOutputKind.DELTA] * 2
    text, tokens, offsets, reasons = {}, {}, {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] = text.get(choice.index, "") + choice.text
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
            offsets.setdefault(choice.index, []).extend(choice.logprobs.text_offset)
            if choice.finish_reason:
                reasons[choice.index] = (choice.finish_reason, choice.stop_reason)
    assert any(c.finish_reason == "stop" for c in whole.choices)
    for choice in whole.choices:
        assert text[choice.index] == choice.text
        assert tokens[choice.index] == choice.logprobs.tokens and offsets[choice.index] == choice.logprobs.text_offset
        assert reasons[choice.index] == (choice.finish_reason, choice.stop_reason)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    server.wait_idle()
    success, generated = _success_and_generated(server)
    assert success - before[0] == 6 and generated - before[1] == whole.usage.completion_tokens
