"""Quantisation as users meet it: `--quantization` (flag, LLMCTL_QUANTIZATION, YAML) through `generate`,
`bench throughput` / `bench latency` and `serve` (the openai client), the weight and KV-cache bytes each of
them reports, and those bytes checked against what a child process really holds (anonymous RSS)."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import textwrap

import openai
import pytest
import torch

from llmctl.cli import run
from test_serve_cli import _env, _start


def run_json_lines(capsys, *args: str) -> list[dict]:
    code = run(list(args))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return [json.loads(line) for line in captured.out.splitlines() if line.strip()]


def generate_memory(capsys, model, *extra: str) -> dict:
    (row,) = run_json_lines(capsys, "generate", "ROMEO:", "-m", str(model), "--max-tokens", "2", "--json",
                            "--dtype", "bfloat16", "--num-kv-blocks", "8", "--max-model-len", "64", *extra)
    assert row["completion_tokens"] == 2
    return row


@pytest.fixture
def no_llmctl_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("LLMCTL_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_generate_json_reports_weight_and_kv_bytes_for_each_way_to_ask(capsys, tiny_chat_model, tmp_path,
                                                                     no_llmctl_env):
    full = generate_memory(capsys, tiny_chat_model)
    assert full["quantization"] is None and full["dtype"] == "bfloat16"
    flag = generate_memory(capsys, tiny_chat_model, "--quantization", "int8")
    no_llmctl_env.setenv("LLMCTL_QUANTIZATION", "int4-g32")
    env = generate_memory(capsys, tiny_chat_model)
    config = tmp_path / "engine.yaml"
    config.write_text("quantization: int8\n")
    yaml = generate_memory(capsys, tiny_chat_model, "--config", str(config))  # the env var still says int4
    no_llmctl_env.delenv("LLMCTL_QUANTIZATION")
    yaml_only = generate_memory(capsys, tiny_chat_model, "--config", str(config))
    assert (flag["quantization"], env["quantization"], yaml["quantization"], yaml_only["quantization"]) == (
        "int8", "int4-g32", "int4-g32", "int8")
    # bf16 holds each linear twice (plain + oneDNN-packed); int8 once at 1 byte; int4 at half a byte
    assert full["weight_bytes"] > flag["weight_bytes"] > env["weight_bytes"] > 0
    assert flag["weight_bytes"] == yaml_only["weight_bytes"]
    assert {r["kv_cache_bytes"] for r in (full, flag, env, yaml, yaml_only)} == {full["kv_cache_bytes"]}
    # 8 blocks x 16 tokens x 2 layers x (K, V) x 2 KV heads x head_dim 16 x 2 bytes
    assert full["kv_cache_bytes"] == 8 * 16 * 2 * 2 * 2 * 16 * 2


def test_generate_json_bytes_are_the_engines(capsys, tiny_chat_model, no_llmctl_env):
    from llmctl.engine import LLM

    row = generate_memory(capsys, tiny_chat_model, "--quantization", "int4-g32")
    llm = LLM(str(tiny_chat_model), dtype="bfloat16", device="cpu", num_kv_blocks=8, max_model_len=64,
              quantization="int4-g32")
    info = llm.engine.model_info
    assert (row["weight_bytes"], row["kv_cache_bytes"]) == (info.weight_bytes, info.kv_cache_bytes)
    assert info.kv_cache_bytes == llm.engine.executor.num_blocks * 16 * 2 * 2 * 2 * 16 * 2


BENCH = ("--input-len", "8", "--output-len", "4", "--dtype", "bfloat16", "--num-kv-blocks", "16",
         "--max-model-len", "64")


def test_bench_throughput_and_latency_report_quantization_and_bytes(capsys, tiny_chat_model, no_llmctl_env):
    model = ("--model", str(tiny_chat_model))
    (full,) = run_json_lines(capsys, "bench", "throughput", *model, *BENCH, "--num-prompts", "4", "--json")
    (int8,) = run_json_lines(capsys, "bench", "throughput", *model, *BENCH, "--num-prompts", "4", "--json",
                             "--quantization", "int8")
    (latency,) = run_json_lines(capsys, "bench", "latency", *model, *BENCH, "--batch-size", "2", "--num-iters", "1",
                                "--num-iters-warmup", "0", "--json", "--quantization", "int4-g32")
    assert (full["quantization"], int8["quantization"], latency["quantization"]) == (None, "int8", "int4-g32")
    assert full["weight_bytes"] > int8["weight_bytes"] > latency["weight_bytes"] > 0
    assert full["kv_cache_bytes"] == int8["kv_cache_bytes"] == latency["kv_cache_bytes"] == 16 * 16 * 2 * 2 * 2 * 16 * 2
    assert int8["output_tokens_per_second"]["mean"] > 0 and latency["avg_latency"] > 0


def test_bench_text_names_the_quantization_and_the_bytes(capsys, tiny_chat_model, no_llmctl_env):
    from llmctl.output import format_bytes

    no_llmctl_env.setenv("LLMCTL_QUANTIZATION", "int8")
    code = run(["bench", "throughput", "--model", str(tiny_chat_model), *BENCH, "--num-prompts", "2"])
    out = capsys.readouterr().out
    assert code == 0
    summary = out.strip().splitlines()[-1]
    kv = format_bytes(16 * 16 * 2 * 2 * 2 * 16 * 2)
    assert "int8 weights, bfloat16, cpu" in summary and f"KV cache {kv}" in summary and "; weights " in summary


def test_serve_with_int8_answers_the_openai_client_and_logs_its_bytes(tiny_chat_model):
    from llmctl.output import format_bytes

    proc, base = _start("--model", str(tiny_chat_model), "--dtype", "bfloat16", "--num-kv-blocks", "16",
                        "--max-model-len", "64", "--api-key", "k", env=_env(LLMCTL_QUANTIZATION="int8"))
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        completion = client.completions.create(model=client.models.list().data[0].id, prompt="ROMEO:",
                                               max_tokens=3, temperature=0)
        assert completion.usage.completion_tokens == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    stderr = proc.stderr.read()
    (line,) = [line for line in stderr.splitlines() if "weights" in line]
    assert line.startswith(f"llmctl serve: {tiny_chat_model}: weights ") and "(int8)" in line
    assert f"KV cache {format_bytes(16 * 16 * 2 * 2 * 2 * 16 * 2)} (bfloat16" in line
    assert stderr.index(line) < stderr.index("listening on")


# ---- the reported weight bytes are what the process holds ----------------------------------------------
RSS_PROBE = textwrap.dedent("""
    import ctypes, gc, json, sys

    def anonymous_rss():
        with open("/proc/self/status") as status:
            return next(int(l.split()[1]) * 1024 for l in status if l.startswith("RssAnon:"))

    from llmctl.engine import LLM

    figures = {}
    for quantization in sys.argv[2:]:  # one engine at a time, all of it freed before the next
        before = anonymous_rss()
        llm = LLM(sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", device="cpu", max_model_len=32,
                  num_kv_blocks=2, quantization=quantization or None)
        gc.collect()
        figures[quantization] = {"growth": anonymous_rss() - before,
                                 "weight_bytes": llm.engine.model_info.weight_bytes}
        del llm
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(json.dumps(figures))
""")


@pytest.fixture(scope="module")
def eight_mb_model(tmp_path_factory):
    """A Llama whose linears hold 3.5 M weights (7 MB in bf16): large against the process's own noise."""
    import transformers

    folder = tmp_path_factory.mktemp("rss") / "llama"
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def rss_growth(folder, *quantizations: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    proc = subprocess.run([sys.executable, "-c", RSS_PROBE, str(folder), *quantizations], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.splitlines()[-1])
    return [figures[q] for q in quantizations]


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="reads RssAnon from /proc/self/status; glibc's malloc_trim")
def test_quantised_weights_occupy_their_quantised_size(eight_mb_model):
    int4, int8, full = rss_growth(eight_mb_model, "int4-g32", "int8", "")
    linear_weights = 4 * (4 * 256 * 256 + 3 * 256 * 768) + 256 * 256  # decoder linears + lm_head
    # bf16: 2 bytes each (AMX tiles; twice, plain + oneDNN's packed copy, on CPUs without AMX); int8: 1 byte
    # each; int4: half a byte each (+ the scales, the bf16 embedding and norms)
    assert full["weight_bytes"] > 2 * linear_weights
    assert linear_weights < int8["weight_bytes"] < 1.1 * linear_weights
    assert linear_weights / 2 < int4["weight_bytes"] < 0.75 * linear_weights
    for figures in (full, int8, int4):
        # Measured here: the growth exceeds the weight bytes by 0.3 MB (the engine's own allocations); with
        # the memory loading freed kept by the allocator, int8 grew 8 MB more than its weights.
        assert abs(figures["growth"] - figures["weight_bytes"]) < 2_000_000, (full, int8, int4)


# ---- benchmarks/quant_quality.py's scoring windows -----------------------------------------------------
def test_perplexity_windows_score_every_token_after_the_first_once_with_half_a_window_of_context():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "quant_quality.py"
    spec = importlib.util.spec_from_file_location("quant_quality", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for num_tokens in (2, 511, 512, 513, 1300):
        plan = module.windows(num_tokens, 512, 256)
        scored = [begin + p for begin, end, first in plan for p in range(first, end - begin)]
        assert scored == list(range(1, num_tokens))
        assert all(first >= 256 for _, _, first in plan[1:]) and all(end - begin <= 512 for begin, end, _ in plan)
