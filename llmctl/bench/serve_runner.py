"""What `llmctl bench serve` does once its flags are parsed: ask the server for its model, find a
tokenizer, build the prompts fitted into the server's context (`datasets`, `dataset_files`), run the
load at each sweep point under a live progress bar on a TTY (`serve_load`), then build the result
document (settings, vLLM's metrics, cost, `--slo` verdicts; a row per point for a sweep), print,
save, plot and export it, and return the exit code."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from llmctl.bench import datasets, serve_load, sweep
from llmctl.bench.client import ENDPOINT_PATHS
from llmctl.errors import UserError

CHAT_DATASETS = ("messages", "conversation")


@dataclass(frozen=True)
class PromptShape:
    dataset: str  # "random", "file", "shared-prefix", "sharegpt", "messages", "conversation" or "trace"
    path: Optional[Path]
    count: int  # timed requests + warm-ups
    input_len: int
    output_len: int
    range_ratio: float
    prefix_len: int
    num_prefixes: int
    seed: int


@dataclass(frozen=True)
class ReportOptions:
    percentiles: list[float]  # shown in the table
    goodput: Optional[dict[str, float]]
    gates: list[Any]
    save_result: Optional[Path]
    plot: Optional[Path]
    computed_percentiles: tuple[float, ...] = ()  # --percentiles plus those --slo gates name
    csv: Optional[Path] = None
    max_failure_rate: float = 0.0
    label: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    latency_metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")  # --percentile-metrics plus those gated
    result_dir: Optional[Path] = None


@dataclass(frozen=True)
class ServeBenchJob:
    base_url: str  # normalized
    endpoint: str
    model: Optional[str]  # None: the first id of GET /v1/models
    api_key: Optional[str]
    request_timeout: float
    plan: serve_load.LoadPlan
    shape: PromptShape
    num_prompts: int
    num_warmups: int
    tokenizer: Optional[str]  # a folder or a Hugging Face id in the local cache
    report: ReportOptions
    save_detailed: bool
    json_output: bool
    price_per_hour: Optional[float] = None
    monthly_request_rate: Optional[float] = None
    sweep_rates: tuple[float, ...] = ()  # empty: the plan's one rate
    sweep_concurrencies: tuple[Optional[int], ...] = ()
    sweep_cooldown_s: float = 1.0
    headers: tuple[tuple[str, str], ...] = ()
    extra_body: Optional[dict[str, Any]] = None
    stream: bool = True

    def plans(self) -> list[serve_load.LoadPlan]:
        """One plan per sweep point: every rate at every concurrency, in the order given."""
        rates = self.sweep_rates or (self.plan.request_rate,)
        limits = self.sweep_concurrencies or (self.plan.max_concurrency,)
        return [replace(self.plan, request_rate=rate, max_concurrency=limit) for limit in limits for rate in rates]


def run_serve_bench(job: ServeBenchJob) -> int:
    """Run the benchmark (each sweep point in turn), print the report, return the exit code."""
    tok, tokenizer = load_tokenizer(job.tokenizer)
    served = serve_load.served_model(job.base_url, job.api_key, job.model)
    if tok is None and (tokenizer := served_tokenizer_folder(served.id)) is not None:
        tok, tokenizer = load_tokenizer(str(tokenizer))
    prompts = fitted_prompts(job.shape, tok, served.max_model_len, job.endpoint == "chat")
    target = serve_load.Target(job.base_url, job.endpoint, served.id, job.api_key, job.request_timeout,
                               job.headers, job.extra_body, job.stream)
    settings = _settings(target, job, tokenizer)
    settings["max_model_len"] = served.max_model_len
    points, runs = [], []
    for number, plan in enumerate(job.plans()):
        if number:
            time.sleep(job.sweep_cooldown_s)  # let the server drain queues and caches between points
        run = _run(target, plan, prompts[job.num_warmups:], prompts[:job.num_warmups], tok)
        points.append(_point_document(settings, plan, run, job))
        runs.append(run)
    document = points[0] if len(points) == 1 else sweep.sweep_document(settings, points)
    _emit(document, job, runs, target)
    return exit_code(document, job.report.max_failure_rate)


def _point_document(settings: dict[str, Any], plan, run, job: ServeBenchJob) -> dict[str, Any]:
    from llmctl.bench.metrics import check_slos

    point_settings = {**settings, "request_rate": sweep.json_rate(plan.request_rate),
                      "max_concurrency": plan.max_concurrency}
    percentiles = list(job.report.computed_percentiles) or job.report.percentiles
    document = serve_load.result_document(point_settings, run, percentiles, job.report.goodput, job.save_detailed,
                                          job.report.latency_metrics)
    if job.price_per_hour is not None:
        document["cost"] = _cost(document, job.price_per_hour, job.monthly_request_rate)
    if job.report.gates:
        document["slo"] = check_slos(job.report.gates, document)
    return document


def _hf_cached_tokenizer(model_id: str) -> Path:
    """The folder of `model_id`'s tokenizer.json in the local Hugging Face cache (offline, no download)."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        raise UserError(f"--tokenizer {model_id}: not a folder, and huggingface_hub is not installed "
                        "to look it up in the Hugging Face cache") from None
    try:
        found = try_to_load_from_cache(model_id, "tokenizer.json")
    except ValueError:  # not a valid repo id
        found = None
    if not isinstance(found, str):
        raise UserError(f"--tokenizer {model_id}: no such folder, and no tokenizer.json for the Hugging Face "
                        f"model {model_id!r} in the local cache ({constants.HF_HUB_CACHE}); fetch it with "
                        f"`huggingface-cli download {model_id} tokenizer.json tokenizer_config.json`")
    return Path(found).parent


def load_tokenizer(spec: Optional[str]):
    """(tokenizer, its folder) from a folder or a Hugging Face id in the local cache; (None, None) for none."""
    if spec is None:
        return None, None
    from llmctl.engine.tokenizer import Tokenizer

    folder = Path(spec).expanduser()
    if not folder.is_dir():
        folder = _hf_cached_tokenizer(spec)
    elif not (folder / "tokenizer.json").is_file():
        raise UserError(f"--tokenizer {spec}: no tokenizer.json there (give the model's folder)")
    try:
        return Tokenizer.from_pretrained(folder), folder
    except Exception as exc:  # noqa: BLE001 - ModelLoadError and friends all mean the same to the user
        raise UserError(f"--tokenizer {spec}: {exc}") from None


def served_tokenizer_folder(model_id: str) -> Optional[Path]:
    """The served model's tokenizer when this machine has it: the embedded model's, or a folder named
    like the model id (vLLM's bench serve likewise loads the tokenizer named by the model)."""
    from llmctl.engine_options import EMBEDDED_MODEL_ID

    if model_id == EMBEDDED_MODEL_ID:
        from llmctl.engine.llm_engine import default_model_path

        return default_model_path()
    folder = Path(model_id).expanduser()
    return folder if (folder / "tokenizer.json").is_file() else None


def fitted_prompts(shape: PromptShape, tok, max_model_len: Optional[int], chat: bool):
    """The prompts, fitted into the server's context (prompt + output <= max_model_len) with a warning."""
    if max_model_len is None:
        return build_prompts(shape, tok)
    context = max_model_len - (datasets.added_tokens(tok, chat) if tok is not None else 0)
    unit = "tokens" if tok is not None else "words (no --tokenizer: they may tokenize longer)"
    if shape.dataset in ("random", "shared-prefix"):
        prefix = shape.prefix_len if shape.dataset == "shared-prefix" else 0
        input_len, output_len, prefix_len = datasets.fit_lengths(shape.input_len, shape.output_len,
                                                                 shape.range_ratio, context, prefix)
        if (input_len, output_len, prefix_len) != (shape.input_len, shape.output_len, prefix):
            asked = f"--random-input-len {shape.input_len} + --random-output-len {shape.output_len}"
            asked += f" + --prefix-len {prefix}" if prefix else ""
            _warn(f"{asked} do not fit the server's max_model_len of {max_model_len}: sending "
                  f"{input_len}{f' + {prefix_len} prefix' if prefix else ''} prompt and {output_len} output {unit}")
            shape = replace(shape, input_len=input_len, output_len=output_len, prefix_len=prefix_len or shape.prefix_len)
    built = build_prompts(shape, tok)
    if shape.dataset == "conversation":
        return built  # the history grows with the server's answers: the server refuses what does not fit
    prompts, capped, too_long = datasets.fit_requests(built, context)
    if capped:
        _warn(f"{capped} request(s) asked for more output than fits the server's max_model_len of "
              f"{max_model_len} after the prompt: their max_tokens were lowered")
    if too_long:
        _warn(f"{too_long} prompt(s) alone fill the server's max_model_len of {max_model_len}; "
              "the server will refuse them")
    return prompts


def build_prompts(shape: PromptShape, tok) -> list:
    import numpy as np

    from llmctl.bench import dataset_files

    rng = np.random.default_rng([shape.seed, 0])
    readers = {
        "file": lambda: datasets.file_requests(shape.path, shape.count, shape.output_len, tok),
        "sharegpt": lambda: dataset_files.sharegpt_requests(shape.path, shape.count, tok),
        "messages": lambda: dataset_files.messages_requests(shape.path, shape.count, shape.output_len, tok),
        "conversation": lambda: dataset_files.conversations(shape.path, shape.count, shape.output_len, tok),
        "trace": lambda: dataset_files.trace_requests(shape.path, shape.count, shape.seed, tok),
        "shared-prefix": lambda: datasets.shared_prefix_requests(
            shape.count, shape.num_prefixes, shape.prefix_len, shape.input_len, shape.output_len,
            shape.range_ratio, rng, tok),
        "random": lambda: datasets.random_requests(shape.count, shape.input_len, shape.output_len,
                                                   shape.range_ratio, rng, tok),
    }
    return readers[shape.dataset]()


def _warn(message: str) -> None:
    import sys

    sys.stderr.write(f"llmctl: warning: {message}\n")


def _run(target, plan, requests, warmups, tok):
    from llmctl.bench.report import load_progress

    total = None if plan.duration_s is not None else _request_count(requests)
    with load_progress(target, plan, total, _request_count(warmups)) as observe:
        return serve_load.run_load(target, plan, requests, warmups, tok, observe)


def _request_count(items: list) -> int:
    """Requests the items make: a conversation sends one per user turn."""
    return sum(len(item.turns) if isinstance(item, datasets.Conversation) else 1 for item in items)


def _settings(target: serve_load.Target, job: ServeBenchJob, tokenizer: Optional[Path]) -> dict[str, Any]:
    from llmctl.__about__ import __version__

    plan = job.plan
    settings = {
        "schema_version": 2,
        "llmctl_version": __version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "label": job.report.label,
        "metadata": job.report.metadata or {},
        "base_url": target.base_url,
        "endpoint": ENDPOINT_PATHS[target.endpoint],
        "model_id": target.model,
        "dataset_name": job.shape.dataset,
        "dataset_path": str(job.shape.path) if job.shape.path else None,
        "num_prompts": job.num_prompts,
        "num_warmups": job.num_warmups,
        "duration_s": plan.duration_s,
        "ramp_up_s": plan.ramp_up_s,
        "request_rate": sweep.json_rate(plan.request_rate),
        "burstiness": plan.burstiness,
        "max_concurrency": plan.max_concurrency,
        "seed": plan.seed,
        "ignore_eos": plan.ignore_eos,
        "stream": target.stream,
        "tokenizer": str(tokenizer) if tokenizer else None,
        "percentiles": job.report.percentiles,
        "goodput_slos_ms": job.report.goodput,
        "max_failure_rate": job.report.max_failure_rate,
    }
    return settings


def _cost(document: dict[str, Any], price_per_hour: float, monthly_request_rate: Optional[float]) -> dict[str, Any]:
    from llmctl.bench.cost import cost_figures

    return cost_figures(price_per_hour, requests_per_s=document["request_throughput"],
                        output_tokens_per_s=document["output_throughput"],
                        total_tokens_per_s=document["total_token_throughput"],
                        monthly_request_rate=monthly_request_rate)


def _emit(document: dict[str, Any], job: ServeBenchJob, runs: list, target) -> None:
    from llmctl.bench.report import print_serve_problems, render_serve, render_sweep
    from llmctl.output import print_json

    if job.json_output:
        print_json(document)
    elif "sweep" in document:
        render_sweep(document)
    else:
        render_serve(document, job.report.percentiles)
    if job.report.save_result is not None:
        _append(job.report.save_result, document)
    if job.report.result_dir is not None:
        _write(job.report.result_dir / result_filename(document), document)
    if job.report.csv is not None:
        sweep.write_csv(job.report.csv, document)
    if job.report.plot is not None:
        _plot(job.report.plot, document, runs, target)
    print_serve_problems(document, job.report.max_failure_rate)


def _plot(path: Path, document: dict[str, Any], runs: list, target) -> None:
    from llmctl.bench import plot

    if "sweep" in document:
        plot.write_sweep_plot(path, document["sweep"], f"{target.model} @ {target.url}: load sweep")
    else:
        plot.write_plot(path, runs[0].outcomes, f"{target.model} @ {target.url} ({document['completed']} requests)")


def result_filename(document: dict[str, Any]) -> str:
    """vLLM's pattern: <label>-<rate>qps-<model>-<date>.json ('sweep' for a sweep's rate)."""
    rate = "sweep" if "sweep" in document else document["request_rate"]
    model = Path(str(document["model_id"])).name or "model"
    stamp = document["date"].replace(":", "").replace("-", "").replace("+0000", "")
    return f"{document['label'] or 'llmctl'}-{rate}qps-{model}-{stamp}.json"


def _append(path: Path, document: dict[str, Any]) -> None:
    """One JSON line per run, so repeated runs (e.g. per --label) collect in one file."""
    _write(path, document, mode="a", flag="--save-result")


def _write(path: Path, document: dict[str, Any], mode: str = "w", flag: str = "--result-dir") -> None:
    from llmctl.output import print_json

    try:
        with path.open(mode) as stream:
            print_json(document, stream=stream)
    except OSError as exc:
        raise UserError(f"cannot write {flag} {path}: {exc.strerror or exc}") from None


def exit_code(document: dict[str, Any], max_failure_rate: float = 0.0) -> int:
    """1 when more requests failed than --max-failure-rate allows (at any point), or the --slo gates
    failed (a sweep: no point met the targets), else 0."""
    rows = document.get("sweep") or [document]
    if any(row["completed"] == 0 or row["failure_rate"] > max_failure_rate for row in rows):
        return 1
    if "sweep" in document:
        return 0 if document["best_point"] is not None or not document["sweep"][0].get("slo") else 1
    return 0 if all(gate["passed"] for gate in document.get("slo", [])) else 1
