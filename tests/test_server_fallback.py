"""The fallback model against a real server on loopback: while the primary's load signal is at
--fallback-at or above, new requests are answered by the fallback (its own tokenizer, its name in
`model`), in-flight ones and token-id prompts stay where they are, and the primary answers again once its load falls;
`/v1/models` lists both, the fallback's name reaches it directly, and no KV block leaks."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmctl.engine.tokenizer import Tokenizer
from llmctl.server.runner import FallbackModel
from tests.server_helpers import injected_step_latency, running_server, wait_for

PRIMARY, FALLBACK = "big", "small"


def _series(base_url: str, name: str) -> dict[str, float]:
    """model_name -> value of one metric family."""
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=10).text):
        if family.name == name:
            return {s.labels["model_name"]: s.value for s in family.samples if not s.name.endswith("_created")}
    return {}


@pytest.fixture()
def fallback_server(tiny_chat_model):
    # The primary (the embedded model) runs at most 2 sequences: two long streams put its
    # running/max_num_seqs term of the load signal at 1.0.
    with running_server(engine_options={"max_num_seqs": 2}, served_model_name=PRIMARY,
                        fallback_served_model_name=FALLBACK,
                        fallback=FallbackModel(str(tiny_chat_model), num_kv_blocks=64)) as srv:
        yield srv


def test_load_over_the_threshold_sends_new_requests_to_the_fallback_and_back(fallback_server, tiny_chat_model):
    srv = fallback_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
    prompt = "To be, or not to be, that is the question"

    calm = client.completions.create(model=PRIMARY, prompt=prompt, max_tokens=4)
    assert calm.model == PRIMARY
    assert _series(srv.base_url, "llmctl:load_signal")[PRIMARY] < 0.8

    # Two long streams fill the primary's batch (slowed: they outlast the checks below on any
    # machine); their chunks keep coming from the primary.
    with injected_step_latency(srv.engine, 0.05):
        streams = [client.completions.create(model=PRIMARY, prompt=prompt, max_tokens=400, stream=True,
                                             extra_body={"ignore_eos": True}) for _ in range(2)]
        firsts = [next(iter(stream)) for stream in streams]
        assert {chunk.model for chunk in firsts} == {PRIMARY}
        wait_for(lambda: _series(srv.base_url, "llmctl:load_signal")[PRIMARY] >= 0.8, what="primary load >= 0.8")

        degraded = client.completions.create(model=PRIMARY, prompt=prompt, max_tokens=4)
        assert degraded.model == FALLBACK
        # Tokenised by the fallback's own tokenizer (a different vocabulary than the primary's).
        small_ids = Tokenizer.from_pretrained(tiny_chat_model).encode(prompt)
        assert degraded.usage.prompt_tokens == len(small_ids) != calm.usage.prompt_tokens
        chat = client.chat.completions.create(model=PRIMARY, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.model == FALLBACK
        assert _series(srv.base_url, "llmctl:fallback_active")[PRIMARY] == 1
        # The in-flight streams were not moved: they still run on the primary.
        assert next(iter(streams[0])).model == PRIMARY
        assert srv.engine.get_stats()["num_running_requests"] == 2
        # Token ids mean something in the primary's vocabulary only: such a request waits for the primary.
        by_ids: list = []
        waiter = threading.Thread(target=lambda: by_ids.append(
            client.completions.create(model=PRIMARY, prompt=[5, 6, 7, 8], max_tokens=2)))
        waiter.start()
        wait_for(lambda: srv.engine.get_stats()["num_waiting_requests"] == 1, what="the token-id request queued")

    for stream in streams:
        stream.close()  # the client leaves: the engine aborts them
    waiter.join(60)
    assert by_ids[0].model == PRIMARY
    wait_for(lambda: _series(srv.base_url, "llmctl:load_signal")[PRIMARY] < 0.7, what="primary load < 0.7")
    recovered = client.completions.create(model=PRIMARY, prompt=prompt, max_tokens=4)
    assert recovered.model == PRIMARY
    assert _series(srv.base_url, "llmctl:fallback_active")[PRIMARY] == 0
    assert _series(srv.base_url, "llmctl:num_requests_degraded")[FALLBACK] == 2
    assert set(_series(srv.base_url, "llmctl:request_success")) == {PRIMARY, FALLBACK}  # each model its own series
    srv.wait_idle()  # every KV block of both engines back


def test_models_lists_both_and_the_fallback_name_goes_to_the_fallback(fallback_server):
    srv = fallback_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
    listed = {model.id: model for model in client.models.list().data}
    assert set(listed) == {PRIMARY, FALLBACK}
    assert client.models.retrieve(FALLBACK).id == FALLBACK
    direct = client.completions.create(model=FALLBACK, prompt="ROMEO:", max_tokens=3)
    assert direct.model == FALLBACK
    assert _series(srv.base_url, "llmctl:num_requests_degraded")[FALLBACK] == 0  # asked for, not degraded
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="other", prompt="x", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found" and "'small'" in missing.value.body["message"]
    srv.wait_idle()


def test_a_burst_over_the_threshold_is_partly_answered_by_the_fallback(tiny_chat_model):
    """24 requests at once against a primary of 4 seats: the router counts those it sent before the
    engine's next snapshot shows them, so the burst spills to the fallback (it all went to the primary)."""
    import asyncio

    with running_server(engine_options={"max_num_seqs": 4}, served_model_name=PRIMARY,
                        fallback_served_model_name=FALLBACK,
                        fallback=FallbackModel(str(tiny_chat_model), num_kv_blocks=64)) as srv:
        async def burst() -> list[str]:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60,
                                         limits=httpx.Limits(max_connections=32)) as http:
                answers = await asyncio.gather(*(http.post("/v1/completions", json={
                    "model": PRIMARY, "prompt": "ROMEO:", "max_tokens": 4}) for _ in range(24)))
            return [answer.json()["model"] for answer in answers]

        with injected_step_latency(srv.engine, 0.02):
            models = asyncio.run(burst())
        assert models.count(FALLBACK) >= 12 and models.count(PRIMARY) >= 4, models
        assert _series(srv.base_url, "llmctl:num_requests_degraded")[FALLBACK] == models.count(FALLBACK)
        wait_for(lambda: _series(srv.base_url, "llmctl:fallback_active")[PRIMARY] == 0,
                 timeout_s=10, what="fallback_active back to 0 once the load fell, with no new request")
        srv.wait_idle()
