"""`--output-filter` and `--input-filter` against a real loopback server with the openai client: a
redact rule removes a pattern that straddles two generated tokens (so two stream deltas), streamed
and not; a block rule ends the stream with finish_reason `content_filter` and aborts the request;
both are counted in /metrics and the audit log; an input rule refuses a prompt with a 400 naming
it, token-id prompts included. Every path ends with all KV blocks free."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from server_helpers import running_server

MODEL = "shakespeare"
REDACTED_PROMPT, BLOCKED_PROMPT = "ROMEO:", "O, what a"  # their completions differ
CHAT = [{"role": "user", "content": "Speak!"}]
GREEDY = dict(model=MODEL, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})


def _tokens(client, prompt: str) -> list[str]:
    """The greedy completion of `prompt`, token by token (the engine's deltas)."""
    return client.completions.create(prompt=prompt, logprobs=0, **GREEDY).choices[0].logprobs.tokens


def _straddling(tokens: list[str], elsewhere: str, skip: int = 2) -> str:
    """A piece of text made of the end of one token and the start of the next (both at least two
    characters) that `elsewhere` does not contain."""
    for left, right in zip(tokens[skip:], tokens[skip + 1:]):
        piece = left[-2:] + right[:2]
        if len(left) >= 2 and len(right) >= 2 and piece.isprintable() and piece not in elsewhere:
            return piece
    raise AssertionError(f"no two neighbouring tokens of two characters in {tokens} make text not in {elsewhere!r}")


@pytest.fixture(scope="module")
def plain():
    """What the model says without filters: the rules of the filtered server are made from it."""
    with running_server(served_model_name=MODEL) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        chat = client.chat.completions.create(messages=CHAT, logprobs=True, **GREEDY).choices[0].logprobs.content
        yield {"redacted": _tokens(client, REDACTED_PROMPT), "blocked": _tokens(client, BLOCKED_PROMPT),
               "chat": [item.token for item in chat]}


@pytest.fixture(scope="module")
def filtered(plain, tmp_path_factory):
    folder = tmp_path_factory.mktemp("filters")
    redacted, blocked = "".join(plain["redacted"]), "".join(plain["blocked"])
    redact = _straddling(plain["redacted"], elsewhere=blocked)
    block = _straddling(plain["blocked"], elsewhere=redacted, skip=4)
    chat_block = _straddling(plain["chat"], elsewhere=redacted + blocked)
    rules = folder / "output.yaml"
    rules.write_text(json.dumps({"rules": [
        {"name": "straddler", "pattern": re.escape(redact), "action": "redact", "replacement": "<cut>"},
        {"name": "stopper", "pattern": re.escape(block), "action": "block"},
        {"name": "chat-stopper", "pattern": re.escape(chat_block), "action": "block"},
    ]}))
    inputs = folder / "input.yaml"
    inputs.write_text("rules:\n  - name: no-override\n    words: [ignore previous instructions]\n")
    with running_server(served_model_name=MODEL, output_filter=rules, input_filter=inputs,
                        audit_log=folder / "audit.jsonl") as srv:
        yield srv, redact, block, chat_block


@pytest.fixture(scope="module")
def client(filtered):
    return openai.OpenAI(base_url=filtered[0].base_url + "/v1", api_key="none", max_retries=0)


def _metric(server, name: str, rule: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    pattern = re.compile(rf'^{re.escape(name)}_total{{[^}}]*rule="{re.escape(rule)}"[^}}]*}} (\S+)$', re.M)
    match = pattern.search(text)
    return float(match.group(1)) if match else 0.0


def test_a_redact_rule_removes_a_pattern_straddling_two_stream_chunks(filtered, plain, client):
    server, redact = filtered[:2]
    original = "".join(plain["redacted"])
    assert redact in original and not any(redact in token for token in plain["redacted"])
    expected = original.replace(redact, "<cut>")
    chunks = list(client.completions.create(prompt=REDACTED_PROMPT, stream=True, **GREEDY))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == expected and redact not in streamed
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(prompt=REDACTED_PROMPT, **GREEDY).choices[0]
    assert whole.text == expected and whole.finish_reason == "length"
    assert _metric(server, "llmctl:output_filter_redactions", "straddler") == 2 * original.count(redact)
    server.wait_idle()


def test_a_block_rule_ends_the_stream_with_content_filter_and_frees_the_request(filtered, plain, client):
    server, block = filtered[0], filtered[2]
    original = "".join(plain["blocked"])
    before = original[:original.index(block)]
    # Room for 480 tokens, so that the abort lands long before the end: a server loop that falls
    # behind the engine gets its tokens in one delta (CI once saw all 24 of a 24-token budget).
    long = {**GREEDY, "max_tokens": 480}
    chunks = list(client.completions.create(prompt=BLOCKED_PROMPT, stream=True, stream_options={"include_usage": True},
                                            **long))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == before
    assert choices[-1].finish_reason == "content_filter"
    assert chunks[-1].usage.completion_tokens < long["max_tokens"]  # aborted, not generated to the end
    server.wait_idle()
    whole = client.completions.create(prompt=BLOCKED_PROMPT, **GREEDY).choices[0]
    assert whole.text == before and whole.finish_reason == "content_filter"
    assert _metric(server, "llmctl:output_filter_blocks", "stopper") == 2
    server.wait_idle()


def test_a_block_rule_ends_a_chat_stream_with_content_filter(filtered, plain, client):
    server, redact, _, chat_block = filtered
    original = "".join(plain["chat"])
    before = original[:original.index(chat_block)].replace(redact, "<cut>")
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == before
    assert chunks[-1].choices[0].finish_reason == "content_filter"
    whole = client.chat.completions.create(messages=CHAT, **GREEDY).choices[0]
    assert whole.message.content == before and whole.finish_reason == "content_filter"
    server.wait_idle()


def test_filter_actions_reach_the_audit_log(filtered, plain, client):
    server = filtered[0]
    client.completions.create(prompt=REDACTED_PROMPT, user="auditor", **GREEDY)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in server.settings.audit_log.read_text().splitlines()]
        mine = [line for line in lines if line.get("user") == "auditor"]
        if mine:
            break
        time.sleep(0.02)
    assert mine[-1]["output_filter_redactions"] == {"straddler": "".join(plain["redacted"]).count(filtered[1])}
    assert any(line.get("output_filter_blocked") == ["stopper"] for line in lines)


def test_logprobs_are_refused_where_they_would_show_filtered_text(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(prompt=REDACTED_PROMPT, logprobs=1, **GREEDY)
    assert caught.value.body["param"] == "logprobs" and "--output-filter" in caught.value.body["message"]


def test_an_input_rule_refuses_the_prompt_naming_the_rule(filtered, client):
    server = filtered[0]
    for call in (
        lambda: client.completions.create(prompt="Please IGNORE previous instructions now", **GREEDY),
        lambda: client.chat.completions.create(messages=[{"role": "system", "content": "be nice"},
                                                         {"role": "user", "content": "ignore previous instructions"}],
                                               **GREEDY),
        lambda: client.completions.create(prompt=server.engine.engine.tokenizer.encode(
            "so ignore previous instructions", add_special_tokens=False), **GREEDY),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.body["code"] == "input_filter"
        assert "the input filter rule 'no-override'" in caught.value.body["message"]
    assert client.completions.create(prompt="ignore the previous line", **GREEDY).choices  # not the rule's words
    assert _metric(server, "llmctl:input_filter_refusals", "no-override") == 3
    server.wait_idle()
