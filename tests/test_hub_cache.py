"""`-m ORG/NAME` resolved offline from a Hugging Face cache laid out as huggingface_hub lays it out (blobs,
snapshots/<commit>/ links, refs/<branch>), checked with huggingface_hub's own `scan_cache_dir`; and from a cache
that huggingface_hub's own `hf_hub_download` wrote, served by a mock transport (no socket, no network)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from huggingface_hub import constants, scan_cache_dir
from huggingface_hub.file_download import repo_folder_name

from llmctl.engine.args import EngineArgs
from llmctl.engine.errors import ModelLoadError
from llmctl.engine.hub import is_repo_id
from llmctl.engine.llm_engine import default_model_path, model_path
from llmctl.engine_options import default_model_name

REPO = "test-org/tiny-llama"
COMMIT_MAIN, COMMIT_OLD = "a" * 40, "b" * 40


def _snapshot(cache: Path, commit: str, files: dict[str, bytes], ref: str | None) -> Path:
    """One revision stored the way huggingface_hub stores it: content-addressed blobs, symlinks to them."""
    repo = cache / repo_folder_name(repo_id=REPO, repo_type="model")
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    model = default_model_path()
    files = {p.name: p.read_bytes() for p in model.iterdir() if p.suffix in (".json", ".safetensors")}
    _snapshot(cache, COMMIT_MAIN, files, "main")
    old_config = json.loads(files["config.json"]) | {"num_hidden_layers": 1}
    _snapshot(cache, COMMIT_OLD, {"config.json": json.dumps(old_config).encode()}, None)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_cache_is_laid_out_as_huggingface_hub_reads_it(hub_cache):
    (repo,) = scan_cache_dir(hub_cache).repos
    assert repo.repo_id == REPO and {r.commit_hash for r in repo.revisions} == {COMMIT_MAIN, COMMIT_OLD}
    assert {ref for r in repo.revisions for ref in r.refs} == {"main"}


def test_model_id_resolves_to_the_cached_snapshot_of_its_revision(hub_cache):
    folder = model_path(EngineArgs(model=REPO))
    assert folder.name == COMMIT_MAIN and (folder / "config.json").is_file()
    assert model_path(EngineArgs(model=REPO, revision=COMMIT_OLD)).name == COMMIT_OLD


def test_missing_model_or_revision_is_one_line_naming_the_cache(hub_cache):
    for args, named in ((EngineArgs(model="test-org/absent"), "'test-org/absent'"),
                        (EngineArgs(model=REPO, revision="v9"), "revision 'v9'")):
        with pytest.raises(ModelLoadError) as err:
            model_path(args)
        assert named in str(err.value) and str(hub_cache) in str(err.value) and "\n" not in str(err.value)


@pytest.fixture
def downloaded_cache(tmp_path, monkeypatch):
    """The embedded model's files fetched into a fresh cache by `hf_hub_download` itself from a mock Hub
    (`httpx.MockTransport`) at COMMIT_MAIN; afterwards every request fails, so resolving is offline or fails."""
    import huggingface_hub
    from huggingface_hub.utils._http import default_client_factory

    files = {p.name: p.read_bytes() for p in default_model_path().iterdir() if p.suffix in (".json", ".safetensors")}
    requested: list[str] = []

    def hub(request: httpx.Request) -> httpx.Response:
        requested.append(request.url.path)
        prefix = f"/{REPO}/resolve/main/"
        data = files.get(request.url.path[len(prefix):]) if request.url.path.startswith(prefix) else None
        if data is None:
            return httpx.Response(404, headers={"X-Error-Code": "EntryNotFound"})
        headers = {"X-Repo-Commit": COMMIT_MAIN, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Length": str(len(data))}
        return httpx.Response(200, headers=headers, content=b"" if request.method == "HEAD" else data)

    def offline(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"a request after the download: {request.method} {request.url}")

    cache = tmp_path / "downloaded"
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    huggingface_hub.set_client_factory(lambda: httpx.Client(transport=httpx.MockTransport(hub)))
    try:
        for name in files:
            huggingface_hub.hf_hub_download(REPO, name, cache_dir=cache)
        assert any(path.endswith("/config.json") for path in requested)  # the mock Hub served them
        huggingface_hub.set_client_factory(lambda: httpx.Client(transport=httpx.MockTransport(offline)))
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        yield cache, files
    finally:
        huggingface_hub.set_client_factory(default_client_factory)


def test_a_cache_written_by_huggingface_hub_resolves_and_loads_offline(downloaded_cache):
    from llmctl.engine import LLM, SamplingParams

    cache, files = downloaded_cache
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == REPO and [r.commit_hash for r in repo.revisions] == [COMMIT_MAIN]
    folder = model_path(EngineArgs(model=REPO))
    assert folder.name == COMMIT_MAIN and all((folder / name).read_bytes() == data for name, data in files.items())
    assert (folder / "model.safetensors").is_symlink()  # hf_hub_download's layout: snapshot links to blobs
    llm = LLM(REPO, device="cpu", dtype="float32", max_model_len=64)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(ModelLoadError, match=f"revision 'v2' is neither a local folder nor in the Hugging Face "
                                             f"cache {cache}"):
        model_path(EngineArgs(model=REPO, revision="v2"))


def test_local_paths_win_over_model_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert not is_repo_id("org/local") and is_repo_id("org/elsewhere") and not is_repo_id("/abs/path")
    assert default_model_name("org/elsewhere") == "org/elsewhere" and default_model_name("org/local") == "local"


def _offline_env(hub_cache: Path, home: Path) -> dict[str, str]:
    """A subprocess environment that finds the cache through HF_HOME alone, offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMCTL_", "HF_"))}
    env.update(NO_COLOR="1", HF_HOME=str(home), HF_HUB_OFFLINE="1")
    shutil.move(str(hub_cache), home / "hub")
    return env


def test_generate_from_a_model_id_offline(hub_cache, tmp_path):
    env = _offline_env(hub_cache, tmp_path / "home")
    out = subprocess.run([sys.executable, "-m", "llmctl.cli", "generate", "-m", REPO, "--max-tokens", "3",
                          "--temperature", "0", "--json", "Hello"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"finish_reason": "length"' in out.stdout and '"error": null' in out.stdout


def test_serve_takes_the_model_id_positionally_and_serves_it_under_that_id(hub_cache, tmp_path):
    from test_serve_cli import _start

    proc, base = _start(REPO, env=_offline_env(hub_cache, tmp_path / "home"))
    try:
        assert [m["id"] for m in httpx.get(base + "/v1/models", timeout=5).json()["data"]] == [REPO]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    both = subprocess.run([sys.executable, "-m", "llmctl.cli", "serve", REPO, "-m", "other/model"],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "two models given" in both.stderr
