"""`llmctl generate` end to end: streaming, batches from files/stdin, JSON lines, config precedence,
and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_cli(*args: str, stdin: str | None = None, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", **(env_extra or {})}
    env = {k: v for k, v in env.items() if not k.startswith("LLMCTL_") or k in (env_extra or {})}
    return subprocess.run([sys.executable, "-m", "llmctl.cli", *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=300)


def test_generate_json_lines_for_a_prompt_file(tiny_chat_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('plain prompt\n{"prompt": "json prompt", "max_tokens": 3}\n'
                       '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}\n')
    proc = run_cli("generate", "-f", str(prompts), "-m", str(tiny_chat_model), "--json", "--max-tokens", "5",
                   "--temperature", "0", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [r["completion_tokens"] for r in rows] == [5, 3, 2]
    assert rows[0]["finish_reason"] == "length"
    assert rows[0]["ttft_s"] > 0 and rows[0]["tokens_per_s"] > 0


def test_generate_reads_stdin_and_streams_plain_text(tiny_chat_model):
    proc = run_cli("generate", "-f", "-", "-m", str(tiny_chat_model), "--max-tokens", "4", stdin="one\ntwo\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("### [") == 2
    single = run_cli("generate", "ROMEO:", "-m", str(tiny_chat_model), "--max-tokens", "4")
    assert single.returncode == 0 and single.stdout.endswith("\n")
    assert "\x1b[" not in single.stdout  # no colour codes when piped


def test_streamed_text_is_the_whole_text_with_a_stop_string_held_back(tiny_chat_model):
    # The stream prints the engine's deltas as they come; a pending stop string is never printed.
    base = ("generate", "To be, or not", "-m", str(tiny_chat_model), "--max-tokens", "24", "-t", "0.8",
            "--sampling-seed", "7", "--ignore-eos")
    whole = json.loads(run_cli(*base, "--json").stdout)["text"]
    stop = next(whole[i:i + 2] for i in range(3, len(whole) - 2) if "\ufffd" not in whole[i:i + 2])
    streamed = run_cli(*base, "--stop", stop)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == whole[:whole.index(stop)] + "\n"


def test_config_file_env_and_flag_precedence(tiny_chat_model, tmp_path):
    config = tmp_path / "gen.yaml"
    config.write_text("max-tokens: 3\ntemperature: 0\nignore_eos: true\n")
    base = ("generate", "hi", "-m", str(tiny_chat_model), "--json", "--config", str(config))
    from_file = json.loads(run_cli(*base).stdout)
    assert from_file["completion_tokens"] == 3
    from_env = json.loads(run_cli(*base, env_extra={"LLMCTL_MAX_TOKENS": "4"}).stdout)
    assert from_env["completion_tokens"] == 4
    from_flag = json.loads(run_cli(*base, "--max-tokens", "5", env_extra={"LLMCTL_MAX_TOKENS": "4"}).stdout)
    assert from_flag["completion_tokens"] == 5


@pytest.mark.parametrize("args, message", [
    (("generate", "hi", "-m", "/no/such/model"), "does not exist"),
    (("generate", "hi", "--temperature", "-1"), "temperature must be >= 0"),
    (("generate",), "give a PROMPT or --file"),
    (("generate", "hi", "--max-tokens", "many"), "--max-tokens"),
    (("generate", "hi", "--dtype", "float64"), "--dtype"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("llmctl: error:")]
    assert len(error_lines) == 1 and message in error_lines[0]
    assert "Traceback" not in proc.stderr


def test_bad_config_file_is_reported(tmp_path, tiny_chat_model):
    config = tmp_path / "bad.yaml"
    config.write_text("no-such-flag: 1\n")
    proc = run_cli("generate", "hi", "-m", str(tiny_chat_model), "--config", str(config))
    assert proc.returncode == 2
    assert "no_such_flag" in proc.stderr


def test_bad_prompt_file_line_is_reported(tmp_path, tiny_chat_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "temprature": 1}\n')
    proc = run_cli("generate", "-f", str(prompts), "-m", str(tiny_chat_model))
    assert proc.returncode == 2
    assert "p.jsonl:1" in proc.stderr and "temprature" in proc.stderr


def _config_only_folder(tiny_models, tmp_path):
    """What `--load-format dummy` is for: a model folder holding config.json alone."""
    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_models["llama"] / "config.json").read_text())
    return folder


def test_load_format_dummy_runs_token_id_prompts_from_config_json_alone(tiny_models, tmp_path):
    folder = _config_only_folder(tiny_models, tmp_path)
    prompts = '{"prompt_token_ids": [5, 6, 7], "max_tokens": 4}\n{"prompt_token_ids": [9], "max_tokens": 2}\n'
    common = ("-m", str(folder), "--load-format", "dummy", "--temperature", "0", "--max-model-len", "64")
    proc = run_cli("generate", "-f", "-", *common, "--json", stdin=prompts)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [len(o["outputs"][0]["token_ids"]) for o in lines] == [4, 2] and lines[0]["prompt_tokens"] == 3
    one = run_cli("generate", "-f", "-", *common, stdin=prompts.splitlines()[0])
    assert one.returncode == 0, one.stderr
    assert one.stdout.split() == [str(t) for t in lines[0]["outputs"][0]["token_ids"]]  # ids, as there is no text


def test_load_format_dummy_with_text_prompt_says_what_is_needed(tiny_models, tmp_path):
    folder = _config_only_folder(tiny_models, tmp_path)
    proc = run_cli("generate", "ROMEO:", "-m", str(folder), "--load-format", "dummy")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"llmctl: error: no tokenizer.json in {folder}: text prompts need a tokenizer; pass --tokenizer FOLDER, "
        'or give token-id prompts: -f FILE with lines like {"prompt_token_ids": [1, 2, 3]}')
    assert "--skip-tokenizer-init" not in proc.stderr
