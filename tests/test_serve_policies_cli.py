"""`llmctl serve` with a fallback model and a concurrency limit, set from YAML `--config` (flags win
over it), and their bad values as one-line errors."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_helpers import free_port
from tests.test_serve_cli import _env, _start


def _samples(base: str) -> dict[tuple[str, str], float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    return {(s.name, s.labels.get("model_name", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_fallback_and_concurrency_from_yaml_config_with_a_flag_overriding_it(tmp_path, tiny_chat_model):
    config = tmp_path / "serve.yaml"
    config.write_text(f"""
served-model-name: big
fallback-model: {tiny_chat_model}
fallback-served-model-name: small
fallback-at: 0.7
fallback-num-kv-blocks: 80
max-concurrency: auto
concurrency-initial: 5
concurrency-max: 50
concurrency-queue: 4
""")
    proc, base = _start("--config", str(config), "--concurrency-initial", "7")
    try:
        models = [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]]
        assert models == ["big", "small"]
        direct = httpx.post(base + "/v1/completions", json={"model": "small", "prompt": "ROMEO:", "max_tokens": 2},
                            timeout=60).json()
        assert direct["model"] == "small"
        samples = _samples(base)
        assert samples[("llmctl:concurrency_limit", "big")] == 7  # the flag beat the YAML's 5
        assert samples[("llmctl:fallback_active", "big")] == 0
        assert ("llmctl:load_signal", "small") in samples
        assert samples[("llmctl:kv_cache_free_blocks", "small")] == 80
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


@pytest.mark.parametrize("args, message", [
    (("--max-concurrency", "lots"), "--max-concurrency must be 'auto' or a whole number >= 1"),
    (("--max-concurrency", "auto", "--concurrency-min", "8", "--concurrency-initial", "4"), "--concurrency-initial"),
    (("--fallback-at", "1.5"), "--fallback-at must be in (0, 1]"),
    (("--fallback-kv-cache-memory", "1000000"), "--fallback-kv-cache-memory needs --fallback-model"),
    (("--fallback-served-model-name", "x"), "--fallback-served-model-name needs --fallback-model"),
    (("--fallback-model", "/no/such/model"), "--fallback-model /no/such/model: model folder /no/such/model does not exist"),
])
def test_bad_policy_flags_are_one_line_errors(args, message):
    proc = subprocess.run([sys.executable, "-m", "llmctl.cli", "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("llmctl: error:")
