"""`llmctl profile server`: torch.profiler traces of a running `llmctl serve --profile-dir DIR` under load.

The sequence is GET /health, POST /start_profile, a short `bench serve` load driven in-process
(`llmctl.bench.serve_load`), then POST /stop_profile, which always runs once recording has started:
after the load, when it fails, and on Ctrl-C, so a server is never left recording. The server writes
the trace on its own disk and answers with its path; when that path is readable here (same host, and
written during this run) the trace is copied into the artifact folder and summarised from its Chrome
trace JSON (event count, the ops with the largest total duration). Otherwise the server paths are
listed and nothing is copied.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import httpx

from llmctl.bench.client import API_KEY_ENV, ENDPOINT_PATHS, auth_headers
from llmctl.errors import UserError
from llmctl.profiling import preflight, ui
from llmctl.profiling.artifacts import Manifest, prepare_output_dir

TOOL = "torch.profiler (via llmctl serve)"
DEFAULT_URL = "http://127.0.0.1:8000"
CONTROL_TIMEOUT_S = 60.0  # start runs on the engine thread, after the step in progress
STOP_TIMEOUT_S = 300.0  # the server exports the whole trace before it answers
READY_WAIT_S = 60.0  # how long a server still warming up (/health 503 "starting") is waited for
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
OP_CATEGORIES = {"cpu_op": "top_ops", "kernel": "top_kernels"}
NATIVE_LABEL = "llmctl::"  # the engine's C kernels, labelled as user annotations (engine/kernels `profiled`)
PERCENTILES = [50.0, 99.0]


@dataclass(frozen=True)
class ServerProfilePlan:
    base_url: str
    api_key: Optional[str] = None
    endpoint: str = "completions"
    num_prompts: int = 16
    request_rate: float = math.inf
    max_concurrency: Optional[int] = None
    random_input_len: int = 64
    random_output_len: int = 32
    seed: int = 0
    row_limit: int = 15

    def load_settings(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "num_prompts": self.num_prompts,
                "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
                "max_concurrency": self.max_concurrency, "random_input_len": self.random_input_len,
                "random_output_len": self.random_output_len, "seed": self.seed}

    def bench_serve_argv(self) -> list[str]:
        """The `llmctl bench serve` command that sends the same load (the key is never spelled out)."""
        argv = ["llmctl", "bench", "serve", "--base-url", self.base_url, "--endpoint", self.endpoint,
                "--num-prompts", str(self.num_prompts), "--request-rate", str(self.request_rate),
                "--random-input-len", str(self.random_input_len), "--random-output-len", str(self.random_output_len),
                "--seed", str(self.seed)]
        if self.max_concurrency is not None:
            argv += ["--max-concurrency", str(self.max_concurrency)]
        return argv

    def http_calls(self) -> list[str]:
        base = self.base_url
        return [f"GET {base}/health", f"POST {base}/start_profile", f"GET {base}/v1/models",
                f"POST {base}{ENDPOINT_PATHS[self.endpoint]} x {self.num_prompts} (streamed)",
                f"POST {base}/stop_profile", f"GET {base}/version"]


def resolve_base_url(base_url: Optional[str], port: Optional[int]) -> str:
    """--base-url, or --port N as http://127.0.0.1:N; the default is http://127.0.0.1:8000."""
    from llmctl.bench.serve_load import normalize_base_url

    if port is not None:
        if not 0 < port < 65536:
            raise UserError(f"--port must be 1-65535, got {port}")
        return f"http://127.0.0.1:{port}"
    return normalize_base_url(base_url or DEFAULT_URL)


def dry_run_plan(plan: ServerProfilePlan) -> dict[str, Any]:
    return {"dry_run": True, "server": plan.base_url, "http_calls": plan.http_calls(),
            "authorization": "Bearer ***" if plan.api_key else None,
            "load": plan.load_settings(), "load_command": plan.bench_serve_argv()}


# ---- talking to the server --------------------------------------------------------------------------

def _unreachable(base: str, exc: Exception) -> UserError:
    return UserError(f"cannot reach the server at {base} ({type(exc).__name__}: {exc}); "
                     "is 'llmctl serve' running, and is --base-url/--port right?")


def _detail(response) -> str:
    """The message of an OpenAI-style error body (llmctl serve, vLLM), else the start of the body."""
    error = _json(response).get("error", _json(response).get("detail"))
    if isinstance(error, dict):
        error = error.get("message")
    text = str(error) if error else response.text
    return " ".join(text.split())[:300] or "(empty body)"


def check_health(client, base: str) -> None:
    """Fail (exit 2) when nothing answers; wait while the server warms up; fail (exit 3) when unhealthy."""
    response = _health(client, base)
    if _starting(response):
        deadline = time.monotonic() + READY_WAIT_S
        with ui.waiting(f"waiting for {base} to finish warming up"):
            while _starting(response) and time.monotonic() < deadline:
                time.sleep(0.5)
                response = _health(client, base)
    if response.status_code != 200:
        raise preflight.fail(f"GET {base}/health answered HTTP {response.status_code}: {_detail(response)}")


def _health(client, base: str):
    try:
        return client.get(base + "/health")
    except httpx.TransportError as exc:
        raise _unreachable(base, exc) from None


def _starting(response) -> bool:
    return response.status_code == 503 and _json(response).get("status") == "starting"


def start_profile(client, plan: ServerProfilePlan) -> dict[str, Any]:
    """POST /start_profile; every refusal becomes an actionable one-line error (exit 3)."""
    url = plan.base_url + "/start_profile"
    try:
        response = client.post(url, headers=auth_headers(plan.api_key), timeout=CONTROL_TIMEOUT_S)
    except httpx.TransportError as exc:
        raise _unreachable(plan.base_url, exc) from None
    status = response.status_code
    if status == 200:
        return _json(response)
    if status in (404, 405):
        raise preflight.fail(f"{url} does not exist (HTTP {status}): start the server with --profile-dir DIR "
                             "(llmctl serve --profile-dir ./traces ...) to enable profiling")
    if status in (401, 403):
        hint = (f"the server rejected the API key: check --api-key or ${API_KEY_ENV}" if plan.api_key else
                f"the server requires an API key: pass --api-key KEY (or set {API_KEY_ENV})")
        raise preflight.fail(f"POST {url} answered HTTP {status}: {hint}")
    if status == 409:
        raise preflight.fail(f"the server is already recording a profile (HTTP 409; another 'llmctl profile server'?); "
                             f"wait for it, or end it with: curl -X POST {plan.base_url}/stop_profile")
    raise preflight.fail(f"POST {url} answered HTTP {status}: {_detail(response)}")


def stop_profile(client, plan: ServerProfilePlan) -> tuple[Optional[list[str]], Optional[str]]:
    """POST /stop_profile: (the trace files the server lists or None when it lists none, error or None)."""
    url = plan.base_url + "/stop_profile"
    try:
        with ui.waiting("stopping the profiler (the server writes the trace)"):
            response = client.post(url, headers=auth_headers(plan.api_key), timeout=STOP_TIMEOUT_S)
    except httpx.TransportError as exc:
        return None, (f"POST {url} failed ({type(exc).__name__}: {exc}); the server may still be recording: "
                      f"curl -X POST {url}")
    if response.status_code != 200:
        return None, f"POST {url} answered HTTP {response.status_code}: {_detail(response)}"
    files = _json(response).get("files")
    return ([str(f) for f in files] if isinstance(files, list) else None), None


def _json(response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _torch_version(client, base: str) -> Optional[str]:
    try:
        return _json(client.get(base + "/version")).get("torch")
    except httpx.HTTPError:
        return None


def _server_pids(base: str) -> list[int]:
    """The PID serving a loopback URL, when this host can see it (for a later `profile cpu --pid`)."""
    url = httpx.URL(base)
    if url.host not in LOOPBACK:
        return []
    try:
        return [preflight.pid_for_port(url.port or (443 if url.scheme == "https" else 80))]
    except UserError:
        return []


# ---- the load -----------------------------------------------------------------------------------

def _run_load(plan: ServerProfilePlan) -> dict[str, Any]:
    import numpy as np

    from llmctl.bench import datasets, serve_load
    from llmctl.bench.metrics import compute_metrics

    model = serve_load.resolve_model(plan.base_url, plan.api_key, None)
    target = serve_load.Target(plan.base_url, plan.endpoint, model, plan.api_key)
    load = serve_load.LoadPlan(plan.request_rate, 1.0, plan.max_concurrency, plan.seed)
    requests = datasets.random_requests(plan.num_prompts, plan.random_input_len, plan.random_output_len, 0.0,
                                        np.random.default_rng([plan.seed, 0]))
    with ui.steps(f"load on {model}", plan.num_prompts) as bar:
        run = serve_load.run_load(target, load, requests, observe=lambda _phase, _outcome: bar.advance())
    metrics = compute_metrics(run.outcomes, run.duration_s, PERCENTILES, None, run.peak_concurrency)
    return {"model": model, **_load_summary(metrics)}


def _load_summary(metrics: dict[str, Any]) -> dict[str, Any]:
    def ms(name: str) -> Optional[dict[str, float]]:
        if not metrics["completed"]:
            return None  # the bench library reports 0 ms for an empty series; here that would read as fast
        return {"mean": round(metrics[f"mean_{name}_ms"], 3), "p50": round(metrics[f"median_{name}_ms"], 3),
                "p99": round(metrics[f"p99_{name}_ms"], 3)}

    return {"completed": metrics["completed"], "failed": metrics["failed"], "duration_s": round(metrics["duration"], 3),
            "request_throughput": round(metrics["request_throughput"], 3),
            "output_throughput": round(metrics["output_throughput"], 3),
            "total_output_tokens": metrics["total_output_tokens"], "ttft_ms": ms("ttft"), "tpot_ms": ms("tpot"),
            "e2el_ms": ms("e2el"), "error_samples": metrics["error_samples"]}


# ---- traces ---------------------------------------------------------------------------------------

def readable_here(remote: str, not_before: float) -> Optional[Path]:
    """The server's trace path when this host can read it and it was written during this run."""
    path = Path(remote)
    try:
        fresh = path.is_file() and os.access(path, os.R_OK) and path.stat().st_mtime >= not_before
    except OSError:
        return None
    return path if fresh else None


def load_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a Chrome/Perfetto trace file (`.json` or `.json.gz`; object or bare array form)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as stream:
        data = json.load(stream)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def summarise_trace(events: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """Event count, time span and, per category (CPU ops, the engine's native kernels among them; CUDA
    kernels), the names with the most total time.

    Totals are inclusive (an `aten::linear` row includes the `aten::addmm` it calls), as the
    profiler's `cpu_time_total` column is.
    """
    spans = [e for e in events if e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))]
    summary: dict[str, Any] = {"events": len(events), "span_ms": None}
    if spans:
        start = min(e["ts"] for e in spans)
        summary["span_ms"] = round((max(e["ts"] + e["dur"] for e in spans) - start) / 1000.0, 3)
    for category, key in OP_CATEGORIES.items():
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for event in spans:
            if event.get("cat") == category or (category == "cpu_op" and event.get("cat") == "user_annotation"
                                                and str(event.get("name", "")).startswith(NATIVE_LABEL)):
                row = totals[str(event.get("name", "?"))]
                row[0] += 1
                row[1] += event["dur"]
        ranked = sorted(totals.items(), key=lambda item: item[1][1], reverse=True)[:limit]
        if ranked or category == "cpu_op":
            summary[key] = [{"name": name, "calls": int(calls), "total_ms": round(dur / 1000.0, 3),
                             "mean_us": round(dur / calls, 3)} for name, (calls, dur) in ranked]
    return summary


def collect_traces(files: list[str], manifest: Manifest, not_before: float, limit: int) -> list[dict[str, Any]]:
    """Copy each readable trace into the artifact folder and summarise it; list the others as server paths."""
    rows = []
    for remote in files:
        row: dict[str, Any] = {"server_path": remote, "local_copy": None, "summary": None}
        source = readable_here(remote, not_before)
        if source is None:
            row["note"] = "not readable on this host (server elsewhere, or another user's folder); fetch it from the server"
            rows.append(row)
            continue
        copy = manifest.output_dir / source.name
        try:
            shutil.copyfile(source, copy)
            manifest.add_file(copy)
            row["local_copy"] = source.name
            row["summary"] = summarise_trace(load_trace(copy), limit)
        except (OSError, ValueError, EOFError) as exc:  # a truncated or foreign file is reported, not fatal
            row["note"] = f"could not read the trace: {exc}"
        rows.append(row)
    return rows


# ---- the whole run -----------------------------------------------------------------------------------

def run_server_profile(plan: ServerProfilePlan, output_dir: Optional[Path], command: list[str]) -> Manifest:
    """Health, start, load, stop (always), collect. The manifest is written however the run ends."""
    with httpx.Client(timeout=10.0) as client:
        check_health(client, plan.base_url)
        started = start_profile(client, plan)
        not_before = time.time() - 2.0  # the trace's mtime is later than this; 2 s of slack for coarse clocks
        manifest: Optional[Manifest] = None
        outcome: tuple[str, Optional[str]] = ("ok", None)
        try:
            manifest = Manifest(kind="server", tool=TOOL, tool_version=None, command=command,
                                output_dir=prepare_output_dir(output_dir, "server"))
            manifest.target_pids = _server_pids(plan.base_url)
            manifest.workload_command = plan.bench_serve_argv()
            manifest.result.update(server=plan.base_url, profile_dir=started.get("profile_dir"),
                                   load_settings=plan.load_settings())
            load = _run_load(plan)
            manifest.result["load"] = load
            if load["completed"] == 0:
                outcome = ("workload_failed", f"all {load['failed']} load requests failed{_first_error(load)}")
        except KeyboardInterrupt:
            outcome = ("interrupted", "interrupted (Ctrl-C) during the load; the trace covers the load so far")
            raise
        except BaseException as exc:
            outcome = ("workload_failed", f"the load failed: {exc}")
            raise
        finally:
            files, error = stop_profile(client, plan)
            if manifest is not None:
                _finalise(manifest, client, plan, files, error, outcome, not_before)
    return manifest


def _first_error(load: dict[str, Any]) -> str:
    samples = load.get("error_samples") or []
    if not samples:
        return ""
    status = "no response" if samples[0]["status"] is None else f"HTTP {samples[0]['status']}"
    return f" ({status}: {samples[0]['message']})"


def _finalise(manifest: Manifest, client, plan: ServerProfilePlan, files: Optional[list[str]], error: Optional[str],
              outcome: tuple[str, Optional[str]], not_before: float) -> None:
    manifest.tool_version = _torch_version(client, plan.base_url)
    manifest.result["server_traces"] = files or []
    manifest.result["traces"] = collect_traces(files or [], manifest, not_before, plan.row_limit)
    status, message = outcome
    if error is not None:
        status, message = ("tool_failed", error) if status == "ok" else (status, f"{message}; also {error}")
    elif files is None:
        manifest.result["note"] = "the server did not list its trace files (look in its profile folder)"
    elif not files and status == "ok":
        status, message = "tool_failed", "the server reported no trace files"
    manifest.finish(status, None, message)
    manifest.write()
