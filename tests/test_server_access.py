"""API keys with attributes (`--api-keys FILE`) and request priorities, against a real loopback
server with the openai client: a key may use only its models (403 `permission_denied`), up to its
max_tokens cap (400), at its rate limits (429), at its priority or later; the audit log names the
key and never holds it; priority scheduling keeps an interactive request's TTFT under a flood of
batch requests that FCFS makes it wait behind. Every path ends with all KV blocks free."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from llmctl.server.api_keys import KeyFileError, load_key_file
from server_helpers import running_server

MODEL = "shakespeare"
KEYS = {"interactive": "sk-interactive-0001", "batch": "sk-batch-000000002", "narrow": "sk-narrow-00000003",
        "quiet": "sk-quiet-000000004", "metered": "sk-metered-0000005"}


def write_key_file(path, body: str):
    path.write_text(body)
    path.chmod(0o600)
    return path


KEY_FILE = f"""
keys:
  - name: interactive
    key: {KEYS['interactive']}
  - name: batch
    key: {KEYS['batch']}
    priority: 10
  - name: narrow
    key: {KEYS['narrow']}
    models: [another-model]
  - name: quiet
    key: {KEYS['quiet']}
    max_tokens: 5
    rate_limit: 2/minute
    audit_prompts: false
  - name: metered
    key: {KEYS['metered']}
    token_rate_limit: 30/minute
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("access")
    keys = write_key_file(folder / "keys.yaml", KEY_FILE)
    with running_server(served_model_name=MODEL, api_keys=keys, audit_log=folder / "audit.jsonl",
                        audit_log_prompts=True, max_output_tokens=64,
                        engine_options={"scheduling_policy": "priority"}) as srv:
        yield srv


def client(server, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEYS[name], max_retries=0)


def audit_lines(server, until) -> list[dict]:
    """The audit log's lines once one satisfies `until` (a line is written after its response was sent)."""
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in server.settings.audit_log.read_text().splitlines()]
        if any(until(line) for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def test_a_key_without_access_to_the_model_gets_403_permission_denied(server):
    narrow = client(server, "narrow")
    with pytest.raises(openai.PermissionDeniedError) as caught:
        narrow.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2)
    assert caught.value.status_code == 403
    assert caught.value.body["code"] == "permission_denied" and caught.value.body["param"] == "model"
    assert "'narrow' may not use the model 'shakespeare'" in caught.value.body["message"]
    with pytest.raises(openai.PermissionDeniedError):  # a request naming no model asks for the served one
        narrow.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert client(server, "interactive").completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2).choices
    assert [m.id for m in narrow.models.list().data] == []  # a key sees the models it may use
    with pytest.raises(openai.PermissionDeniedError):
        narrow.models.retrieve(MODEL)
    assert [m.id for m in client(server, "interactive").models.list().data] == [MODEL]
    server.wait_idle()


def test_over_the_keys_max_tokens_cap_is_400_and_its_default_is_the_cap(server):
    quiet = client(server, "quiet")
    with pytest.raises(openai.BadRequestError) as caught:
        quiet.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6)
    assert caught.value.body["param"] == "max_tokens" and caught.value.body["code"] == "max_tokens_exceeded"
    assert "limit of the API key 'quiet': 5 tokens" in caught.value.body["message"]
    out = quiet.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                        extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    # The key allows 2 requests a minute: the refused one above was counted too.
    with pytest.raises(openai.RateLimitError) as limited:
        quiet.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert "rate limit exceeded for the API key 'quiet'" in limited.value.body["message"]
    assert int(limited.value.response.headers["retry-after"]) >= 1
    server.wait_idle()


def test_a_token_budget_refuses_the_key_once_spent(server):
    metered = client(server, "metered")
    out = metered.completions.create(model=MODEL, prompt="ROMEO: " * 4, max_tokens=24, extra_body={"ignore_eos": True})
    assert out.usage.total_tokens > 30  # counted when the response ended: the budget is now below zero
    with pytest.raises(openai.RateLimitError) as limited:
        metered.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert "used its token budget (30 tokens per 60 s)" in limited.value.body["message"]
    client(server, "interactive").completions.create(model=MODEL, prompt="x", max_tokens=1)  # others unaffected
    server.wait_idle()


def test_the_audit_log_names_the_key_never_holds_it_and_keeps_prompts_only_where_allowed(server):
    client(server, "interactive").completions.create(model=MODEL, prompt="OPEN PROMPT", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-wrong-key", max_retries=0).models.list()
    lines = audit_lines(server, lambda line: line["status"] == 401)
    text = server.settings.audit_log.read_text()
    assert not any(key in text for key in KEYS.values())
    named = [line for line in lines if line.get("api_key_name")]
    assert {line["api_key_name"] for line in named} >= {"narrow", "quiet", "interactive"}
    assert any(line.get("prompt") == ["OPEN PROMPT"] for line in named if line["api_key_name"] == "interactive")
    assert all("prompt" not in line for line in named if line["api_key_name"] == "quiet")
    assert next(line for line in lines if line["status"] == 401).get("api_key_name") is None


def test_a_keys_priority_is_its_default_and_the_earliest_it_may_ask_for(server):
    batch = client(server, "batch")
    with pytest.raises(openai.PermissionDeniedError) as caught:
        batch.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 3})
    assert caught.value.body["param"] == "priority"
    assert "may not ask for priority 3: its requests run at priority 10 or later" in caught.value.body["message"]
    assert batch.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 20}).choices
    assert client(server, "interactive").completions.create(model=MODEL, prompt="x", max_tokens=1,
                                                            extra_body={"priority": -5}).choices
    server.wait_idle()


def test_key_files_are_refused_with_one_line_naming_the_problem(tmp_path):
    loose = tmp_path / "loose.yaml"
    loose.write_text(KEY_FILE)
    loose.chmod(0o644)
    with pytest.raises(KeyFileError, match=r"permissions 0644 let other users read or change the keys; "
                                           r"run 'chmod 600 .*loose.yaml'"):
        load_key_file(loose)
    for body, message in [
        ("keys:\n  - name: a\n    key: short\n", "at least 8 characters"),
        ("keys:\n  - name: a\n    key: sk-aaaaaaaa\n  - name: b\n    key: sk-aaaaaaaa\n", "are the same key"),
        ("keys:\n  - name: a\n    key: sk-aaaaaaaa\n    models: []\n", "'models' must be a non-empty list"),
        ("keys:\n  - name: a\n    key_sha256: abc\n", "64 hex digits"),
        ("keys:\n  - name: a\n    key: sk-aaaaaaaa\n    rate_limit: lots\n", "invalid rate limit"),
        ("keys:\n  - name: a\n    key: sk-aaaaaaaa\n    role: admin\n", "unknown field(s) role"),
    ]:
        path = write_key_file(tmp_path / "keys.yaml", body)
        with pytest.raises(KeyFileError, match=re.escape(message)) as caught:
            load_key_file(path)
        assert "\n" not in str(caught.value)


def test_a_key_given_by_its_sha256_is_accepted(tmp_path):
    import hashlib

    digest = hashlib.sha256(b"sk-hashed-key-123").hexdigest()
    ring = load_key_file(write_key_file(tmp_path / "keys.yaml", f"keys:\n  - name: h\n    key_sha256: {digest}\n"))
    assert ring.find("sk-hashed-key-123").name == "h"
    assert ring.find("sk-hashed-key-124") is None


# ---- priority against FCFS under a flood -----------------------------------------------------------
FLOOD, FLOOD_TOKENS = 5, 128  # long enough that the flood is still queued when the gauge is read (12 drained first)
QUEUE_WAIT_S = 60.0


async def _ttft_under_flood(base_url: str, batch_key: str, interactive_key: str) -> float:
    """Seconds to the first token of an interactive request sent while FLOOD batch requests queue
    for a batch of one (--max-num-seqs 1)."""
    batch = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=batch_key, max_retries=0, timeout=600)
    interactive = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=interactive_key, max_retries=0, timeout=600)
    flood = [asyncio.create_task(batch.completions.create(model=MODEL, prompt=f"Scene {i}:", max_tokens=FLOOD_TOKENS,
                                                          extra_body={"ignore_eos": True}))
             for i in range(FLOOD)]
    deadline = time.monotonic() + QUEUE_WAIT_S
    async with httpx.AsyncClient(timeout=10) as http:
        while _gauge((await http.get(base_url + "/metrics")).text, "llmctl:num_requests_waiting") < FLOOD - 1:
            assert time.monotonic() < deadline, f"the flood never queued {FLOOD - 1} requests"
            assert not all(task.done() for task in flood), "the flood finished before it was seen queued"
            await asyncio.sleep(0.02)
    started = time.monotonic()
    stream = await interactive.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2, stream=True,
                                                  extra_body={"ignore_eos": True})
    ttft = None
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.monotonic() - started
    await asyncio.gather(*flood)
    return ttft


def _gauge(metrics: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def fcfs_server():
    with running_server(served_model_name=MODEL, engine_options={"max_num_seqs": 1, "scheduling_policy": "fcfs"}) as srv:
        yield srv


def test_priority_beats_fcfs_for_ttft_under_a_flood(tmp_path, fcfs_server):
    keys = write_key_file(tmp_path / "keys.yaml", KEY_FILE)
    fcfs = asyncio.run(_ttft_under_flood(fcfs_server.base_url, "none", "none"))
    fcfs_server.wait_idle()
    with running_server(served_model_name=MODEL, api_keys=keys,
                        engine_options={"max_num_seqs": 1, "scheduling_policy": "priority"}) as srv:
        priority = asyncio.run(_ttft_under_flood(srv.base_url, KEYS["batch"], KEYS["interactive"]))
        srv.wait_idle()
    # FCFS: behind the whole queue (~FLOOD x FLOOD_TOKENS steps); priority: behind the running one at most.
    assert priority * 2 < fcfs, f"TTFT priority {priority:.2f} s, fcfs {fcfs:.2f} s"


def test_a_priority_under_fcfs_is_refused_naming_it(fcfs_server):
    plain = openai.OpenAI(base_url=fcfs_server.base_url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        plain.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 1})
    assert caught.value.body["param"] == "priority"
    assert "needs the priority scheduling policy (--scheduling-policy priority)" in caught.value.body["message"]
    assert plain.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 0}).choices
    fcfs_server.wait_idle()


def test_the_key_file_in_the_docs_loads(tmp_path):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "serve.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", doc, re.S) if b.startswith("keys:"))
    ring = load_key_file(write_key_file(tmp_path / "keys.yaml", block))
    assert ring.find("sk-chat-7f3a9c0e21").max_tokens == 512 and ring.find("test").priority == 10


def test_a_token_budget_goes_below_zero_by_what_was_spent_and_refills_at_its_rate():
    from llmctl.server.middleware import RateLimit, TokenBuckets

    now = [0.0]
    budget = TokenBuckets(RateLimit(30, 60.0), clock=lambda: now[0])  # 0.5 tokens per second
    assert budget.wait("k") == 0
    budget.take("k", 45.0)  # a response that used 45 tokens: 15 below zero
    assert budget.wait("k") == pytest.approx(32.0)  # back at one token after (1 + 15) / 0.5 s
    now[0] = 31.0
    assert budget.wait("k") > 0
    now[0] = 32.0
    assert budget.wait("k") == 0
