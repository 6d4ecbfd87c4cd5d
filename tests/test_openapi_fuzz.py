"""The served /openapi.json tells the truth, and bounded property-based fuzzing of its request
schemas (hypothesis-jsonschema) finds no 5xx and no error body outside OpenAI's shape; schemathesis,
all operations and all its checks, finds no failure."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis_jsonschema import from_schema

from server_helpers import rss_mib, running_server

ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server():
    # Small caps keep each generated request cheap: the fuzzing is about the answers, not the work.
    with running_server(max_output_tokens=3, max_sequences_per_request=4, max_body_bytes=256 * 1024) as srv:
        yield srv


@pytest.fixture(scope="module")
def document(server):
    return httpx.get(server.base_url + "/openapi.json").json()


def test_the_document_says_400_not_422_with_the_openai_error_schema(document):
    assert "HTTPValidationError" not in document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (path, method)
    post = document["paths"]["/v1/completions"]["post"]
    assert post["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"}
    assert {"400", "401", "413", "429", "503"} <= set(post["responses"])
    body_ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    completion = document["components"]["schemas"][body_ref.rsplit("/", 1)[1]]
    assert completion["additionalProperties"] is False and "prompt" in completion["required"]
    operation_ids = [op["operationId"] for ops in document["paths"].values() for op in ops.values()]
    assert len(operation_ids) == len(set(operation_ids))


def _request_schema(document: dict, path: str) -> dict:
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return {**ref, "components": document["components"]}


def _check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in map(json.loads, events[:-1]):
            assert "error" not in event or set(event["error"]) == ERROR_KEYS


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzing_the_request_schemas_finds_no_5xx(server, document, path):
    before = rss_mib()
    schema = _request_schema(document, path)

    @settings(max_examples=30, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(body=from_schema(schema))
    def fuzz(body):
        _check_answer(http.post(path, json=body))

    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        fuzz()
    server.assert_recovered(before)


def test_the_document_declares_what_the_server_accepts_and_sends(server, document):
    schemas = document["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"], schemas["CompletionRequest"]
    # null means the default in any optional field: documented nullable
    assert {"type": "null"} in chat["properties"]["add_generation_prompt"]["anyOf"]
    answered = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": None, "max_tokens": 2})
    assert answered.status_code == 200, answered.text
    # a refused field is advertised only with the values that pass
    assert chat["properties"]["moderation"]["enum"] == [None]
    assert completion["properties"]["use_beam_search"]["enum"] == [None, False]
    assert completion["properties"]["suffix"]["enum"] == [None, ""]
    assert "enum" not in chat["properties"]["response_format"]  # response formats are served
    # what depends on the model and flags: this template renders no tools, fcfs takes priority 0 only,
    # token ids are below the vocabulary's size, content parts are text (the model takes no images)
    assert chat["properties"]["tools"]["enum"] == [None] and chat["properties"]["priority"]["enum"] == [None, 0]
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] == {
        "type": "integer", "minimum": 0, "maximum": server.engine.model_info.vocab_size - 1}
    assert "MediaPart" not in schemas and "MediaPart" not in json.dumps(document)
    # a whole number written 2.0 is the integer the schema says it is
    assert httpx.post(server.base_url + "/v1/completions", timeout=60,
                      json={"prompt": [[5.0, 6.0]], "max_tokens": 2.0, "n": 1.0}).status_code == 200
    # the server's caps: n <= 16 and --max-seqs-per-request (4 here), max_tokens <= --max-output-tokens (3 here,
    # below the default 16: required)
    assert {"type": "integer", "minimum": 1, "maximum": 4} == {k: v for k, v in
                                                              completion["properties"]["n"]["anyOf"][0].items()}
    assert "max_tokens" in completion["required"]
    # content types: Prometheus text for /metrics, Server-Sent Events for streamed answers
    metrics_ok = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics_ok) == ["text/plain; version=0.0.4; charset=utf-8"]
    assert httpx.get(server.base_url + "/metrics").headers["content-type"] == list(metrics_ok)[0]
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "text/event-stream" in document["paths"][path]["post"]["responses"]["200"]["content"]


def test_schemathesis_all_operations_all_checks_find_no_failure(server, tmp_path):
    """Every phase (examples, coverage, fuzzing, stateful): schema-valid requests are accepted, invalid
    ones refused with a documented status, and every answer matches its documented schema and content
    type. Bounded (a fixed seed, 3 examples per operation) to stay within the suite's budget."""
    pytest.importorskip("schemathesis", reason="schemathesis is in the test extra; not installed here")
    run = subprocess.run([sys.executable, "-m", "schemathesis.cli", "run", server.base_url + "/openapi.json",
                          "--checks", "all", "--max-examples", "3", "--seed", "46", "--workers", "2",
                          "--request-timeout", "60", "--no-color", "--continue-on-failure"],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert "11 selected / 11 total" in run.stdout  # every operation of the document
