"""Commands parse, call and render; what several of them share exists once: the endpoint choice,
the API-key fallback, the byte formatter."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmctl.bench import client
from llmctl.cli import build_cli
from llmctl.output import format_bytes

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "commands").glob("*.py"), *(ROOT / "llmctl").rglob("*.py")])


def option(path: tuple[str, ...], name: str):
    command = build_cli()
    for part in path:
        command = command.commands[part]
    return next(p for p in command.params if p.name == name)


def test_bench_serve_and_profile_server_take_one_endpoint_type():
    for path in (("bench", "serve"), ("profile", "server")):
        param = option(path, "endpoint")
        assert param.type_descriptor.annotation is client.Endpoint, path
        assert param.help == client.ENDPOINT_HELP
        assert option(path, "api_key").help == client.API_KEY_HELP
    assert {e.value for e in client.Endpoint} == set(client.ENDPOINT_PATHS)


def test_api_key_fallback(monkeypatch):
    monkeypatch.delenv(client.API_KEY_ENV, raising=False)
    assert client.api_key(None) is None
    monkeypatch.setenv(client.API_KEY_ENV, "sk-env")
    assert client.api_key(None) == "sk-env"
    assert client.api_key("sk-flag") == "sk-flag"
    monkeypatch.setenv(client.API_KEY_ENV, "")
    assert client.api_key("") is None  # an empty key sends no Authorization header
    assert client.auth_headers(None) == {} and client.auth_headers("k") == {"Authorization": "Bearer k"}


def test_only_the_client_module_reads_the_openai_key_or_builds_bearer_headers():
    offenders = [str(p.relative_to(ROOT)) for p in SOURCES if p.name != "client.py" and "server" not in p.parts
                 and re.search(r"OPENAI_API_KEY|f\"Bearer \{", p.read_text())]
    assert not offenders, offenders


@pytest.mark.parametrize("num_bytes, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"), (256 * 2 ** 20, "256 MiB"),
    (12.34 * 2 ** 20, "12.3 MiB"), (1.5 * 2 ** 30, "1.5 GiB"), (141 * 10 ** 9, "131.3 GiB"), (3 * 2 ** 40, "3 TiB"),
    (-2048, "-2 KiB"),
])
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text


def test_no_other_function_formats_bytes_in_binary_units():
    """`llmctl.output.format_bytes` is the one formatter (before: commands/profile.py, bench/kernels.py,
    bench/report.py and profiling/leak.py each divided by 2**20 or 2**30 themselves)."""
    unit_in_fstring = re.compile(r"f\"[^\"\n]*\}\s?(KiB|MiB|GiB)\b")
    offenders = [str(p.relative_to(ROOT)) for p in SOURCES if unit_in_fstring.search(p.read_text())]
    assert not offenders, offenders
