"""`llmctl bench throughput` / `bench latency`: workload generation and statistics against
hand-computed values, JSON documents on tiny models (real and dummy weights, a dataset file),
`--compare-hf`, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from llmctl.bench import offline
from llmctl.cli import run


def llmctl(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    return subprocess.run([sys.executable, "-m", "llmctl.cli", *args], capture_output=True, text=True,
                          env={**env, "NO_COLOR": "1", **(env_extra or {})}, timeout=300)


def run_json(capsys, *args: str) -> dict:
    code = run(list(args))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


# ---- workload and statistics --------------------------------------------------------------------
def test_length_bounds_follow_vllm_symmetric_range():
    assert offline.length_bounds(100, 0.0) == (100, 100)
    assert offline.length_bounds(100, 0.25) == (75, 125)
    assert offline.length_bounds(10, 0.33) == (6, 14)  # floor(6.7), ceil(13.3)
    assert offline.length_bounds(1, 0.9) == (1, 2)  # never below one token


def test_random_requests_are_seeded_and_within_bounds():
    a = offline.random_requests(200, 40, 20, 0.5, 1000, seed=3)
    assert a == offline.random_requests(200, 40, 20, 0.5, 1000, seed=3)
    assert a != offline.random_requests(200, 40, 20, 0.5, 1000, seed=4)
    in_lens = [len(r.prompt_token_ids) for r in a]
    out_lens = [r.output_len for r in a]
    assert min(in_lens) >= 20 and max(in_lens) <= 60 and len(set(in_lens)) > 10
    assert min(out_lens) >= 10 and max(out_lens) <= 30
    assert all(0 <= t < 1000 for r in a for t in r.prompt_token_ids)
    fixed = offline.random_requests(5, 7, 3, 0.0, 50, seed=0)
    assert {len(r.prompt_token_ids) for r in fixed} == {7} and {r.output_len for r in fixed} == {3}


def test_percentiles_and_mean_std_by_hand():
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    p = offline.percentiles(values, (0, 10, 25, 50, 90, 99, 100))
    # sorted 1..5; rank = 4 * p / 100, linear between neighbours
    assert p == {"0": 1.0, "10": pytest.approx(1.4), "25": 2.0, "50": 3.0, "90": pytest.approx(4.6),
                 "99": pytest.approx(4.96), "100": 5.0}
    stats = offline.mean_std(values)
    assert stats["mean"] == 3.0 and stats["std"] == pytest.approx(2.5 ** 0.5)  # sample std
    assert offline.mean_std([2.0]) == {"mean": 2.0, "std": 0.0}


def test_pass_times_rates():
    times = offline.PassTimes([2.0, 4.0], num_requests=10, prompt_tokens=300, output_tokens=100)
    rates = times.rates()
    assert rates["requests_per_second"]["mean"] == pytest.approx((5.0 + 2.5) / 2)
    assert rates["output_tokens_per_second"]["mean"] == pytest.approx((50 + 25) / 2)
    assert rates["total_tokens_per_second"]["std"] == pytest.approx(((200 - 100) ** 2 / 2) ** 0.5)


@pytest.mark.parametrize("lengths, message", [
    ((0, 8, 0.0, 64), "--input-len must be >= 1"),
    ((8, 0, 0.0, 64), "--output-len must be >= 1"),
    ((8, 8, 1.5, 64), "--range-ratio must be in [0, 1)"),
    ((8, 8, -0.1, 64), "--range-ratio must be in [0, 1)"),
    ((40, 30, 0.0, 64), "--input-len 40 + --output-len 30 exceeds max-model-len 64"),
    ((30, 20, 0.5, 64), "(up to 75 with --range-ratio 0.5)"),
])
def test_check_lengths_errors(lengths, message):
    from llmctl.errors import UserError

    with pytest.raises(UserError, match=None) as info:
        offline.check_lengths(*lengths, "m")
    assert message in str(info.value)
    offline.check_lengths(32, 32, 0.0, 64, "m")  # exactly fits


# ---- end to end ---------------------------------------------------------------------------------
def test_throughput_json_on_a_tiny_model(capsys, tiny_models):
    doc = run_json(capsys, "bench", "throughput", "--model", str(tiny_models["llama"]), "--num-prompts", "12",
                   "--input-len", "24", "--output-len", "6", "--range-ratio", "0.5", "--repeats", "2",
                   "--dtype", "float32", "--json")
    assert doc["schema_version"] == 1 and doc["benchmark"] == "throughput" and doc["device"] == "cpu"
    assert doc["dtype"] == "float32" and doc["enable_prefix_caching"] is False and doc["tensor_parallel_size"] == 1
    work = doc["workload"]
    assert work["source"] == "random" and work["num_prompts"] == 12 and work["range_ratio"] == 0.5
    expected = offline.random_requests(12, 24, 6, 0.5, 512, 0)
    assert work["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in expected)
    assert work["output_tokens"] == sum(r.output_len for r in expected)
    assert doc["repeats"] == 2 and len(doc["elapsed_times"]) == 2 and doc["num_requests"] == 12
    rates = [work["output_tokens"] / s for s in doc["elapsed_times"]]
    assert doc["output_tokens_per_second"]["mean"] == pytest.approx(sum(rates) / 2)
    assert doc["requests_per_second"]["std"] >= 0
    assert doc["total_num_tokens"] == work["prompt_tokens"] + work["output_tokens"]
    assert doc["transformers"] is None and doc["ratio_vs_transformers"] is None


def test_throughput_compare_hf_prints_the_ratio(capsys, tiny_models):
    doc = run_json(capsys, "bench", "throughput", "--model", str(tiny_models["qwen2"]), "--num-prompts", "6",
                   "--input-len", "16", "--output-len", "5", "--compare-hf", "--hf-batch-size", "4",
                   "--dtype", "float32", "--json")
    hf = doc["transformers"]
    assert hf["version"] and hf["batch_size"] == 4 and hf["num_requests"] == 6
    assert hf["total_num_tokens"] == doc["total_num_tokens"]
    ratio = doc["ratio_vs_transformers"]["output_tokens_per_second"]
    assert ratio == pytest.approx(doc["output_tokens_per_second"]["mean"] / hf["output_tokens_per_second"]["mean"])
    code = run(["bench", "throughput", "--model", str(tiny_models["qwen2"]), "--num-prompts", "4", "--input-len", "8",
                "--output-len", "3", "--compare-hf", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert code == 0 and "transformers" in out and "llmctl / transformers = " in out


def test_latency_json_and_compare_hf(capsys, tiny_models):
    doc = run_json(capsys, "bench", "latency", "--model", str(tiny_models["llama"]), "--batch-size", "3",
                   "--input-len", "10", "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "5",
                   "--compare-hf", "--dtype", "float32", "--json")
    assert doc["benchmark"] == "latency" and len(doc["latencies"]) == 5
    assert doc["avg_latency"] == pytest.approx(sum(doc["latencies"]) / 5)
    assert list(doc["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert doc["percentiles"]["50"] == pytest.approx(sorted(doc["latencies"])[2])
    assert doc["workload"]["prompt_tokens"] == 30 and doc["workload"]["output_tokens"] == 12
    hf = doc["transformers"]
    assert len(hf["latencies"]) == 5
    assert doc["ratio_vs_transformers"]["speedup_mean_latency"] == pytest.approx(hf["avg_latency"] / doc["avg_latency"])


def test_dummy_weights_from_config_json_only(capsys, tiny_models, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_models["qwen3"] / "config.json", folder / "config.json")
    doc = run_json(capsys, "bench", "throughput", "--model", str(folder), "--load-format", "dummy",
                   "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--compare-hf", "--json")
    assert doc["load_format"] == "dummy" and doc["workload"]["output_tokens"] == 16
    assert doc["transformers"]["output_tokens_per_second"]["mean"] > 0


def test_dataset_file_with_text_and_token_prompts(capsys, tiny_chat_model, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('To be, or not to be\n{"prompt_token_ids": [5, 6, 7], "max_tokens": 2}\n'
                    '{"messages": [{"role": "user", "content": "hi"}]}\n')
    doc = run_json(capsys, "bench", "throughput", "--model", str(tiny_chat_model), "--dataset", str(data),
                   "--output-len", "3", "--json")
    work = doc["workload"]
    assert work["source"] == f"dataset:{data}" and work["num_prompts"] == 3
    assert work["output_tokens"] == 3 + 2 + 3
    doc = run_json(capsys, "bench", "throughput", "--model", str(tiny_chat_model), "--dataset", str(data),
                   "--num-prompts", "2", "--output-len", "3", "--json")
    assert doc["num_requests"] == 2


def test_config_file_env_and_flag_precedence(tiny_models, tmp_path):
    config = tmp_path / "bench.yaml"
    config.write_text("num-prompts: 4\ninput-len: 6\noutput-len: 5\ndtype: float32\n")
    proc = llmctl("bench", "throughput", "--config", str(config), "--model", str(tiny_models["llama"]),
                  "--num-prompts", "2", "--json", env_extra={"LLMCTL_OUTPUT_LEN": "3"})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["num_requests"] == 2  # flag over YAML
    assert doc["workload"]["output_len"] == 3  # env over YAML
    assert doc["workload"]["input_len"] == 6 and doc["dtype"] == "float32"  # YAML over defaults


def test_transformers_is_not_imported_without_compare_hf(tiny_models):
    code = ("import sys; from llmctl.cli import run; "
            f"rc = run(['bench', 'throughput', '--model', {str(tiny_models['llama'])!r}, '--num-prompts', '2', "
            "'--input-len', '4', '--output-len', '2', '--json']); "
            "print('transformers' in sys.modules, rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == "False 0", proc.stderr


def test_compare_hf_without_transformers_is_a_clear_error(tiny_models, tmp_path):
    blocker = tmp_path / "site" / "transformers"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('transformers is blocked in this test')\n")
    proc = llmctl("bench", "latency", "--model", str(tiny_models["llama"]), "--batch-size", "1", "--input-len", "4",
                  "--output-len", "2", "--num-iters-warmup", "0", "--num-iters", "1", "--compare-hf",
                  env_extra={"PYTHONPATH": f"{blocker.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "llmctl: error: --compare-hf needs transformers: pip install transformers"


@pytest.mark.parametrize("args, message", [
    (["throughput", "--input-len", "0"], "--input-len must be >= 1"),
    (["throughput", "--range-ratio", "1.5"], "--range-ratio must be in [0, 1)"),
    (["throughput", "--input-len", "400", "--output-len", "200"], "exceeds max-model-len 512"),
    (["throughput", "--max-model-len", "64", "--input-len", "60", "--output-len", "8"], "exceeds max-model-len 64"),
    (["throughput", "--num-prompts", "0"], "--num-prompts"),
    (["throughput", "--dataset", "/no/such/file.jsonl"], "cannot read --dataset /no/such/file.jsonl"),
    (["throughput", "--model", "/no/such/model"], "does not exist"),
    (["latency", "--batch-size", "200"], "--batch-size 200 exceeds --max-num-seqs 128"),
    (["latency", "--output-len", "0"], "--output-len must be >= 1"),
    (["latency", "--input-len", "500", "--output-len", "20"], "exceeds max-model-len 512"),
    (["--cpu", "latency"], "--cpu belong(s) to the hardware benchmark"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    proc = llmctl("bench", *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmctl: error:"), proc.stderr
    assert message in lines[0]


def test_dataset_errors_name_the_line(tmp_path, tiny_chat_model):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt_token_ids": [1, 2, 99999]}\n')
    proc = llmctl("bench", "throughput", "--model", str(tiny_chat_model), "--dataset", str(data))
    assert proc.returncode == 2 and "prompt 1: token ids must be integers in [0, 512)" in proc.stderr
    data.write_text("hello\n")
    proc = llmctl("bench", "throughput", "--model", str(tiny_chat_model), "--dataset", str(data),
                  "--num-prompts", "5")
    assert proc.returncode == 2 and "--num-prompts 5 but" in proc.stderr and "holds only 1 prompts" in proc.stderr


# ---- speculative decoding --------------------------------------------------------------------------
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'


def test_throughput_and_latency_report_acceptance_with_a_speculative_config(capsys, tiny_models, tmp_path):
    data = tmp_path / "repeating.jsonl"
    phrase = list(range(40, 52))
    data.write_text("".join(json.dumps({"prompt_token_ids": phrase * 4 + [40 + i]}) + "\n" for i in range(4)))
    doc = run_json(capsys, "bench", "throughput", "--model", str(tiny_models["llama"]), "--dataset", str(data),
                   "--output-len", "12", "--repeats", "2", "--dtype", "float32", "--speculative-config", NGRAM, "--json")
    assert doc["speculative_config"]["method"] == "ngram" and doc["speculative_config"]["num_speculative_tokens"] == 3
    spec = doc["spec_decode"]
    assert 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"] <= 3 * spec["num_drafts"]
    assert spec["acceptance_rate"] == pytest.approx(spec["num_accepted_tokens"] / spec["num_draft_tokens"])
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    # Both passes counted, the warm-up not: each pass verifies the same drafts (greedy, same prompts).
    assert spec["num_drafts"] % 2 == 0
    code = run(["bench", "throughput", "--model", str(tiny_models["llama"]), "--dataset", str(data),
                "--output-len", "12", "--dtype", "float32", "--speculative-config", NGRAM])
    out = capsys.readouterr().out
    assert code == 0 and "draft tokens accepted (" in out and "mean acceptance length" in out

    doc = run_json(capsys, "bench", "latency", "--model", str(tiny_models["llama"]), "--batch-size", "2",
                   "--input-len", "16", "--output-len", "8", "--num-iters-warmup", "1", "--num-iters", "2",
                   "--dtype", "float32", "--speculative-config", NGRAM, "--json")
    assert doc["speculative_config"]["prompt_lookup_max"] == 3
    assert set(doc["spec_decode"]) == {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                                       "mean_acceptance_length"}


def test_without_a_speculative_config_the_documents_say_none(capsys, tiny_models):
    doc = run_json(capsys, "bench", "latency", "--model", str(tiny_models["llama"]), "--batch-size", "1",
                   "--input-len", "8", "--output-len", "3", "--num-iters-warmup", "0", "--num-iters", "1",
                   "--dtype", "float32", "--json")
    assert doc["speculative_config"] is None and doc["spec_decode"] is None


def test_throughput_reports_the_tensor_parallel_size(capsys, tiny_models):
    from llmctl.bench.report import render_throughput

    doc = run_json(capsys, "bench", "throughput", "--model", str(tiny_models["llama"]), "--num-prompts", "4",
                   "--input-len", "8", "--output-len", "3", "--dtype", "float32", "-tp", "2", "--json")
    assert doc["tensor_parallel_size"] == 2 and doc["workload"]["output_tokens"] == 12
    render_throughput(doc)
    assert "float32, cpu, tensor parallel 2)" in capsys.readouterr().out
