"""Embeddings served by the engine: pooling requests against transformers' own hidden states (tiny random
checkpoints), alone, mixed with generation, chunked, and with the pooler settings a checkpoint declares."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl.engine.errors import InvalidRequestError
from llmctl.engine.llm import LLM
from llmctl.engine.pooling import PoolingParams
from llmctl.engine.sampling_params import SamplingParams
from tests.conftest import make_tiny_model

PROMPTS = [[5, 17, 42, 99, 3, 250, 8, 61, 77, 12, 400, 33, 2, 9, 18, 140, 7], [11, 12, 13], [300]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("embed") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def reference_hidden(qwen3):
    """transformers' final hidden states (after the final norm) per prompt, float32."""
    import transformers

    model = transformers.AutoModel.from_pretrained(qwen3, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).last_hidden_state[0] for ids in PROMPTS]


def _llm(folder, **options) -> LLM:
    return LLM(str(folder), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, block_size=16, **options)


def _vectors(outputs) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in outputs]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_pooled_hidden_states_match_transformers(qwen3, reference_hidden, pooling_type):
    llm = _llm(qwen3, pooling_type=pooling_type)
    got = _vectors(llm.embed(PROMPTS, PoolingParams(normalize=False)))
    pick = {"LAST": lambda h: h[-1], "MEAN": lambda h: h.mean(0), "CLS": lambda h: h[0]}[pooling_type]
    for vector, hidden in zip(got, reference_hidden):
        torch.testing.assert_close(vector, pick(hidden), atol=1e-4, rtol=1e-4)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_bf16_embeddings_within_bf16_tolerance(qwen3, reference_hidden):
    llm = LLM(str(qwen3), dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=64, pooling_type="MEAN")
    for vector, hidden in zip(_vectors(llm.embed(PROMPTS, PoolingParams(normalize=False))), reference_hidden):
        torch.testing.assert_close(vector, hidden.mean(0), atol=5e-2, rtol=5e-2)  # bf16: 8 mantissa bits per op


def test_normalize_is_the_default_and_mixed_batches_pool_alike(qwen3, reference_hidden):
    """Default LAST + L2 norm; the same vectors when the pooling requests share steps with generation, and
    every KV block is back once all finished."""
    llm = _llm(qwen3)
    alone = _vectors(llm.embed(PROMPTS))
    for vector, hidden in zip(alone, reference_hidden):
        torch.testing.assert_close(vector, torch.nn.functional.normalize(hidden[-1], dim=0), atol=1e-4, rtol=1e-4)
        assert vector.norm().item() == pytest.approx(1.0, abs=1e-5)
    engine = llm.engine
    engine.add_request("gen-0", [1, 2, 3, 4], SamplingParams(max_tokens=6, temperature=0))
    engine.add_request("gen-1", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0))
    engine.step()  # generation is running when the pooling requests arrive
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"emb-{i}", ids, PoolingParams())
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step().outputs if o.finished})
    assert len(finished["gen-0"].outputs[0].token_ids) == 6
    for i, vector in enumerate(alone):
        torch.testing.assert_close(torch.tensor(finished[f"emb-{i}"].outputs.embedding), vector, atol=1e-5, rtol=1e-5)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_chunked_prefill_mean_pools_every_chunk(qwen3, reference_hidden):
    llm = _llm(qwen3, pooling_type="MEAN", max_num_batched_tokens=16, max_num_seqs=2)
    got = _vectors(llm.embed(PROMPTS, PoolingParams(normalize=False)))
    assert len(PROMPTS[0]) > 16  # its prefill took two steps
    for vector, hidden in zip(got, reference_hidden):
        torch.testing.assert_close(vector, hidden.mean(0), atol=1e-4, rtol=1e-4)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_prefix_cache_serves_last_pooling_only(qwen3, reference_hidden, pooling_type):
    """A generation request caches the prompt's first block: LAST pooling reuses it (only the last token's
    hidden state is read), MEAN recomputes it (a cached block holds no hidden states)."""
    llm = _llm(qwen3, pooling_type=pooling_type)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1))
    hits = llm.engine.get_stats()["prefix_cache_hits"]
    vector = llm.embed([PROMPTS[0]], PoolingParams(normalize=False))[0].outputs.data
    pick = reference_hidden[0][-1] if pooling_type == "LAST" else reference_hidden[0].mean(0)
    torch.testing.assert_close(vector, pick, atol=1e-4, rtol=1e-4)
    assert (llm.engine.get_stats()["prefix_cache_hits"] > hits) == (pooling_type == "LAST")


def test_preempted_pooling_request_pools_from_scratch(qwen3, reference_hidden):
    """Three blocks for a decoding request and a chunked mean-pooling one: the pooling one is preempted halfway
    (the newest), recomputes, and pools the same (its first chunk's sum is not counted twice)."""
    llm = LLM(str(qwen3), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=3, block_size=16,
              max_num_batched_tokens=16, pooling_type="MEAN", max_model_len=32)
    engine = llm.engine
    engine.add_request("gen", list(range(1, 16)), SamplingParams(max_tokens=10, temperature=0))
    engine.step()
    engine.add_request("emb", PROMPTS[0], PoolingParams(normalize=False))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step().outputs if o.finished})
    assert outputs["emb"].metrics.num_preemptions >= 1
    torch.testing.assert_close(outputs["emb"].outputs.data, reference_hidden[0].mean(0), atol=1e-4, rtol=1e-4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_llama_pooling_matches_transformers(tmp_path):
    import transformers

    folder = make_tiny_model(tmp_path / "llama", "llama")
    with torch.no_grad():
        hidden = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32)(
            torch.tensor([PROMPTS[0]])).last_hidden_state[0]
    vector = _llm(folder, pooling_type="MEAN").embed([PROMPTS[0]], PoolingParams(normalize=False))[0].outputs.data
    torch.testing.assert_close(vector, hidden.mean(0), atol=1e-4, rtol=1e-4)


def test_dimensions_need_a_matryoshka_checkpoint(tmp_path, qwen3):
    with pytest.raises(InvalidRequestError, match="dimensions: this model does not declare Matryoshka"):
        _llm(qwen3).embed([PROMPTS[1]], PoolingParams(dimensions=8))
    folder = make_tiny_model(tmp_path / "matryoshka", "qwen3", matryoshka_dimensions=[16, 32])
    llm = _llm(folder)
    full, cut = (llm.embed([PROMPTS[0]], PoolingParams(dimensions=d, normalize=False))[0].outputs.data
                 for d in (None, 16))
    torch.testing.assert_close(cut, full[:16])
    normalized = llm.embed([PROMPTS[0]], PoolingParams(dimensions=32))[0].outputs.data
    torch.testing.assert_close(normalized, torch.nn.functional.normalize(full[:32], dim=0))
    with pytest.raises(InvalidRequestError, match=r"dimensions 24 is not supported by this model \(supported: \[16, 32\]"):
        llm.embed([PROMPTS[0]], PoolingParams(dimensions=24))


def test_sentence_transformers_pooling_config_is_read(tmp_path, reference_hidden):
    folder = make_tiny_model(tmp_path / "st", "qwen3")
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_lasttoken": False}))
    llm = _llm(folder)
    assert (llm.engine.pooler_config.pooling_type, llm.engine.pooler_config.normalize) == ("MEAN", False)
    torch.testing.assert_close(_vectors(llm.embed([PROMPTS[0]]))[0], reference_hidden[0].mean(0), atol=1e-4, rtol=1e-4)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_max_tokens": True, "include_prompt": True}))
    llm = _llm(folder)  # generation is unaffected; embeddings name what they cannot run
    assert len(llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    with pytest.raises(InvalidRequestError, match="sentence-transformers pooling_mode_max_tokens"):
        llm.embed([PROMPTS[1]])


def test_over_long_prompt_is_refused(qwen3):
    llm = _llm(qwen3, max_model_len=16)
    with pytest.raises(InvalidRequestError, match="max_model_len is 16"):
        llm.embed([PROMPTS[0]])


# ---- /v1/embeddings ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory):
    from tests.conftest import save_tiny_tokenizer
    from tests.server_helpers import running_server

    root = tmp_path_factory.mktemp("embed-server")
    folder = make_tiny_model(root / "qwen3", "qwen3", bos_token_id=0, eos_token_id=1, matryoshka_dimensions=[16, 64])
    save_tiny_tokenizer(folder)
    with running_server(folder, engine_options={"dtype": "float32", "max_model_len": 64},
                        served_model_name="tiny-embed", audit_log=root / "audit.jsonl") as server:
        yield server


def test_openai_sdk_embeddings_float_and_base64(embedding_server):
    from tests.server_helpers import openai_client

    client = openai_client(embedding_server)
    texts = ["To be, or not to be", "that is the question"]
    # the SDK asks for base64 by default and decodes it (little-endian float32)
    decoded = client.embeddings.create(model="tiny-embed", input=texts)
    floats = client.embeddings.create(model="tiny-embed", input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1]
    for a, b in zip(decoded.data, floats.data):
        assert len(a.embedding) == 64
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)
        assert sum(x * x for x in b.embedding) == pytest.approx(1.0, abs=1e-5)
    tokenizer = embedding_server.engine.model_info.tokenizer
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    ids = client.embeddings.create(model="tiny-embed", input=[tokenizer.encode(texts[0])], encoding_format="float")
    assert ids.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-6)
    cut = client.embeddings.create(model="tiny-embed", input=texts[0], dimensions=16, encoding_format="float")
    assert len(cut.data[0].embedding) == 16
    embedding_server.wait_idle()


@pytest.mark.parametrize("body, status, names", [
    ({"input": "x" * 5000}, 400, "context of 64 tokens (max_model_len"),
    ({"input": list(range(2, 80))}, 400, "max_model_len"),
    ({"input": "hi", "dimensions": 24}, 400, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "truncate_prompt_tokens": 4}, 400, "truncate_prompt_tokens"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": ["a"] * 257}, 400, "input"),
    ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
    ({"input": "hi", "model": "other"}, 404, "other"),
])
def test_refused_embedding_requests(embedding_server, body, status, names):
    from tests.server_helpers import post_json

    response = post_json(embedding_server, "/v1/embeddings", body)
    assert response.status_code == status, response.text
    assert names in response.text


def test_embeddings_are_counted_in_metrics_and_the_audit_log(embedding_server):
    import httpx

    from tests.server_helpers import post_json

    response = post_json(embedding_server, "/v1/embeddings", {"input": ["a", "b", "c"], "user": "u-7"})
    assert response.status_code == 200
    text = httpx.get(embedding_server.base_url + "/metrics").text
    assert 'endpoint="/v1/embeddings"' in text
    assert 'finished_reason="stop"' in text
    line = _audit_line(embedding_server.settings.audit_log, user="u-7")
    assert line["path"] == "/v1/embeddings" and line["status"] == 200
    assert line["prompt_tokens"] == response.json()["usage"]["prompt_tokens"] and line["completion_tokens"] == 0
    document = httpx.get(embedding_server.base_url + "/openapi.json").json()
    assert "/v1/embeddings" in document["paths"]  # with the bounds the server enforces
    assert document["components"]["schemas"]["EmbeddingRequest"]["properties"]["input"]["anyOf"][1]["maxItems"] == 256


def _audit_line(path, user: str, timeout_s: float = 10.0) -> dict:
    """The audit log's line for `user`'s request (written as the response ends: waited for)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [json.loads(text) for text in path.read_text().splitlines()] if path.exists() else []
        found = [line for line in lines if line.get("user") == user]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no audit line for user {user!r} in {path}")


# ---- llmctl generate --embed -------------------------------------------------------------------------------
def test_generate_embed_writes_one_json_line_per_prompt(qwen3, reference_hidden, tmp_path):
    from tests.test_generate_cli import run_cli

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"prompt_token_ids": ids}) + "\n" for ids in PROMPTS))
    proc = run_cli("generate", "--embed", "-f", str(docs), "-m", str(qwen3), "--dtype", "float32",
                   "--pooling-type", "MEAN", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2]
    for line, hidden in zip(lines, reference_hidden):
        torch.testing.assert_close(torch.tensor(line["embedding"]),
                                   torch.nn.functional.normalize(hidden.mean(0), dim=0), atol=1e-4, rtol=1e-4)
    summary = json.loads(proc.stderr.strip().splitlines()[-1])["summary"]
    assert summary["embeddings"] == 3 and summary["prompt_tokens"] == sum(map(len, PROMPTS))
    assert summary["pooling_type"] == "MEAN" and summary["dimensions"] == 64
    assert "\x1b[" not in proc.stderr  # no progress bar off a TTY


@pytest.mark.parametrize("line, extra, message", [
    ({"prompt_token_ids": [1, 2]}, ("--chat",), "--embed does not take --chat/--system"),
    ({"messages": [{"role": "user", "content": "hi"}]}, (), "--embed takes `prompt` or `prompt_token_ids` lines"),
    ({"prompt": "hi", "max_tokens": 3}, (), "--embed takes no sampling parameters (max_tokens)"),
])
def test_generate_embed_refusals(qwen3, tmp_path, line, extra, message):
    """Refused before the model loads."""
    from tests.test_generate_cli import run_cli

    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps(line) + "\n")
    proc = run_cli("generate", "--embed", "-f", str(docs), "-m", str(qwen3), *extra)
    assert proc.returncode != 0
    assert message in proc.stderr
