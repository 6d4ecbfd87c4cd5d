"""`llmctl bench serve`: load-test any OpenAI-compatible server and report vLLM's serving metrics.

Parses and checks every flag before the first request; `llmctl.bench.serve_runner` then runs the
load (one point, or a sweep over comma lists of rates and concurrencies) and reports it.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmctl.bench.client import API_KEY_HELP, ENDPOINT_HELP, Endpoint
from llmctl.config import ConfigOption

LOAD = "Load"
DATA = "Dataset"
REPORT = "Report"


class DatasetName(str, Enum):
    random = "random"
    file = "file"
    shared_prefix = "shared-prefix"
    sharegpt = "sharegpt"
    messages = "messages"
    conversation = "conversation"
    trace = "trace"


def _o(*names: str, panel: str, **kwargs: Any):
    return typer.Option(*names, rich_help_panel=panel, **kwargs)


def serve(
    base_url: Annotated[str, typer.Option("--base-url", help="Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine).")] = "http://127.0.0.1:8000",
    endpoint: Annotated[Optional[Endpoint], typer.Option("--endpoint", help=ENDPOINT_HELP)] = None,
    model: Annotated[Optional[str], typer.Option("--model", envvar="LLMCTL_BENCH_SERVE_MODEL", help="Model name to request (default: the first id of GET /v1/models).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help=API_KEY_HELP)] = None,
    header: Annotated[Optional[list[str]], typer.Option("--header", metavar="K=V", help="HTTP header sent with every request (repeatable).")] = None,
    extra_body: Annotated[Optional[str], typer.Option("--extra-body", metavar="JSON", help="JSON object merged into every request body, e.g. '{\"top_p\": 0.9}'.")] = None,
    stream: Annotated[bool, typer.Option("--stream/--no-stream", help="Stream the answers (SSE); --no-stream: TTFT = E2E latency.")] = True,
    request_rate: Annotated[str, _o("--request-rate", panel=LOAD, help="Requests per second; inf sends all at once. A comma list (1,4,16,inf) sweeps.")] = "inf",
    burstiness: Annotated[float, _o("--burstiness", panel=LOAD, help="Gamma shape of the arrivals: 1 = Poisson, < 1 burstier, > 1 steadier.")] = 1.0,
    max_concurrency: Annotated[Optional[str], _o("--max-concurrency", panel=LOAD, help="Most requests in flight at once (default: no limit). A comma list (1,8,32) sweeps.")] = None,
    sweep_cooldown: Annotated[float, _o("--sweep-cooldown", panel=LOAD, min=0.0, help="Seconds of rest between the points of a sweep.")] = 1.0,
    num_prompts: Annotated[int, _o("--num-prompts", panel=LOAD, min=1, help="Timed requests to send (conversations for --dataset-name conversation; the prompt pool with --duration).")] = 1000,
    duration: Annotated[Optional[float], _o("--duration", panel=LOAD, metavar="SECONDS", help="Send requests (cycling the prompts) for this long instead of --num-prompts once.")] = None,
    ramp_up: Annotated[float, _o("--ramp-up", panel=LOAD, metavar="SECONDS", min=0.0, help="Grow the request rate linearly from 0 over this long.")] = 0.0,
    num_warmups: Annotated[int, _o("--num-warmups", panel=LOAD, min=0, help="Untimed requests sent (and finished) before the benchmark.")] = 0,
    seed: Annotated[int, _o("--seed", panel=LOAD, envvar="LLMCTL_BENCH_SERVE_SEED", help="Seed of the prompts and of the arrival times.")] = 0,
    ignore_eos: Annotated[bool, _o("--ignore-eos/--no-ignore-eos", panel=LOAD, help="Ask for exactly max_tokens (vLLM's ignore_eos extension).")] = True,
    temperature: Annotated[float, _o("--temperature", panel=LOAD, min=0.0, help="Sampling temperature sent with each request.")] = 0.0,
    request_timeout: Annotated[float, _o("--request-timeout", panel=LOAD, envvar="LLMCTL_BENCH_SERVE_REQUEST_TIMEOUT", min=0.001, help="Seconds without a byte from the server before a request fails.")] = 600.0,
    request_id_prefix: Annotated[str, _o("--request-id-prefix", panel=LOAD, help="Prefix of the X-Request-Id sent with each request (recorded with --save-detailed).")] = "bench-",
    dataset: Annotated[DatasetName, _o("--dataset", "--dataset-name", panel=DATA, envvar="LLMCTL_BENCH_SERVE_DATASET", help="random, shared-prefix, or a --dataset-path file: file (JSONL prompts), sharegpt, messages, conversation (multi-turn; these two default to --endpoint chat), trace (mooncake JSONL).")] = DatasetName.random,
    dataset_path: Annotated[Optional[Path], _o("--dataset-path", panel=DATA, dir_okay=False, help="The dataset file; formats in docs/bench.md.")] = None,
    random_input_len: Annotated[int, _o("--random-input-len", panel=DATA, min=1, help="Prompt tokens (random; the suffix for shared-prefix).")] = 1024,
    random_output_len: Annotated[int, _o("--random-output-len", panel=DATA, min=1, help="Output tokens (max_tokens); also the default for file, messages and conversation turns.")] = 128,
    random_range_ratio: Annotated[float, _o("--random-range-ratio", panel=DATA, help="Lengths uniform in [L(1-r), L(1+r)], 0 <= r < 1.")] = 0.0,
    prefix_len: Annotated[int, _o("--prefix-len", panel=DATA, min=1, help="shared-prefix: tokens of the prefix each group shares.")] = 256,
    num_prefixes: Annotated[int, _o("--num-prefixes", panel=DATA, min=1, help="shared-prefix: number of distinct prefixes (groups).")] = 10,
    tokenizer: Annotated[Optional[str], _o("--tokenizer", panel=DATA, help="Folder with tokenizer.json, or a Hugging Face id in the local cache: exact prompt lengths and a token count fallback.")] = None,
    percentiles: Annotated[str, _o("--percentiles", "--metric-percentiles", panel=REPORT, help="Percentiles reported for TTFT, TPOT, ITL and E2EL.")] = "50,90,99",
    percentile_metrics: Annotated[str, _o("--percentile-metrics", panel=REPORT, help="Latency metrics reported (mean, median, std, percentiles): a comma list of ttft, tpot, itl, e2el.")] = "ttft,tpot,itl,e2el",
    goodput: Annotated[Optional[list[str]], _o("--goodput", panel=REPORT, metavar="KEY:MS", help="Per-request SLOs for goodput: ttft:MS tpot:MS e2el:MS (repeatable).")] = None,
    slo: Annotated[Optional[list[str]], _o("--slo", panel=REPORT, metavar="EXPR", help="Gate such as 'p99_ttft_ms<500' (repeatable; < <= > >=); exit 1 when violated.")] = None,
    max_failure_rate: Annotated[float, _o("--max-failure-rate", panel=REPORT, min=0.0, max=1.0, help="Share of requests allowed to fail (0-1) before the exit code is 1.")] = 0.0,
    json_output: Annotated[bool, _o("--json", panel=REPORT, help="Print only the result document as JSON on stdout.")] = False,
    save_result: Annotated[Optional[Path], _o("--save-result", panel=REPORT, dir_okay=False, help="Append the JSON result document to this file (one line per run).")] = None,
    result_dir: Annotated[Optional[Path], _o("--result-dir", panel=REPORT, file_okay=False, help="Also write the JSON result document to a new file named after the label, rate, model and time in this folder.")] = None,
    label: Annotated[Optional[str], _o("--label", panel=REPORT, help="Name of this run, stored in the result.")] = None,
    metadata: Annotated[Optional[list[str]], _o("--metadata", panel=REPORT, metavar="K=V", help="Free-form key=value stored in the result (repeatable).")] = None,
    csv: Annotated[Optional[Path], _o("--csv", panel=REPORT, dir_okay=False, help="Write one CSV row per load point.")] = None,
    save_detailed: Annotated[bool, _o("--save-detailed", panel=REPORT, help="Add per-request ids, lengths, times, texts and errors to the JSON.")] = False,
    plot: Annotated[Optional[Path], _o("--plot", panel=REPORT, dir_okay=False, help="Latency histograms and throughput over time; for a sweep the load curve (.png, .svg, .pdf).")] = None,
    price_per_hour: Annotated[Optional[float], _o("--price-per-hour", panel=REPORT, metavar="USD", help="Instance price: adds USD per 1M output/total tokens and per month (compute only).")] = None,
    monthly_request_rate: Annotated[Optional[float], _o("--monthly-request-rate", panel=REPORT, metavar="REQ_PER_S", help="Request rate the monthly cost is for (default: the measured one).")] = None,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Benchmark an OpenAI-compatible server under load: TTFT, TPOT, ITL, E2E latency, throughput, goodput.

    Exit codes: 0 = done and every --slo gate held; 1 = more requests failed than --max-failure-rate
    allows (default: any), or a gate was violated (a sweep: no point met the targets); 2 = usage
    error, unreachable server, or the first requests all refused (401/403/404).

    Example: llmctl bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 1,4,16 --slo 'p99_ttft_ms<500' --plot curve.png
    """
    from llmctl.bench import client, serve_load
    from llmctl.bench.cost import check_cost_flags
    from llmctl.bench.serve_runner import CHAT_DATASETS, PromptShape, ServeBenchJob, run_serve_bench

    report = _report_options(percentiles, percentile_metrics, goodput, slo, save_result, plot, csv, max_failure_rate,
                             label, metadata, result_dir)
    check_cost_flags(price_per_hour, monthly_request_rate)
    rates, limits = _sweep(request_rate, max_concurrency)
    plan = _plan(rates[0], burstiness, limits[0], seed, ignore_eos, temperature, duration, ramp_up, request_id_prefix)
    base = serve_load.normalize_base_url(base_url)
    _check_dataset_flags(dataset, dataset_path, random_range_ratio, endpoint, request_rate)
    chosen = endpoint.value if endpoint else ("chat" if dataset.value in CHAT_DATASETS else "completions")
    shape = PromptShape(dataset.value, dataset_path, num_prompts + num_warmups, random_input_len, random_output_len,
                        random_range_ratio, prefix_len, num_prefixes, seed)
    job = ServeBenchJob(base, chosen, model, client.api_key(api_key), request_timeout, plan, shape,
                        num_prompts, num_warmups, tokenizer, report, save_detailed, json_output, price_per_hour,
                        monthly_request_rate, tuple(rates), tuple(limits), sweep_cooldown,
                        _pairs(header or [], "--header"), _extra_body(extra_body), stream)
    job.plans()  # every sweep point's plan is checked (e.g. --ramp-up against a rate of inf) before any request
    raise typer.Exit(run_serve_bench(job))


# ---- flag checks ---------------------------------------------------------------------------------

def _report_options(percentiles: str, percentile_metrics: str, goodput: Optional[list[str]], slo: Optional[list[str]],
                    save_result: Optional[Path], plot: Optional[Path], csv: Optional[Path], max_failure_rate: float,
                    label: Optional[str], metadata: Optional[list[str]], result_dir: Optional[Path]):
    from llmctl.bench.metrics import (metric_keys, parse_goodput, parse_metric_names, parse_percentiles, parse_slo,
                                      slo_needs)
    from llmctl.bench.plot import check_plot_path
    from llmctl.bench.serve_runner import ReportOptions
    from llmctl.errors import UserError

    try:
        points = parse_percentiles(percentiles)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--percentiles")
    try:
        slos = parse_goodput(goodput or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--goodput")
    try:
        shown = parse_metric_names(percentile_metrics)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--percentile-metrics")
    # A gate on p99_ttft_ms needs p99 of TTFT computed even when the report does not show it.
    gated_points, gated_metrics = slo_needs(slo or [])
    computed = points + [p for p in gated_points if p not in points]
    latency_metrics = shown + tuple(name for name in gated_metrics if name not in shown)
    keys = metric_keys(computed, bool(slos), latency_metrics)
    gates = []
    for text in slo or []:
        if not slos and text.strip().startswith("request_goodput"):
            raise UserError("--slo on request_goodput needs --goodput (the per-request SLOs it counts)")
        try:
            gates.append(parse_slo(text, keys))
        except ValueError as exc:
            raise UserError(f"--slo {exc}") from None
    for flag, path in (("--save-result", save_result), ("--csv", csv)):
        if path is not None and not path.resolve().parent.is_dir():
            raise UserError(f"{flag} {path}: folder {path.resolve().parent} does not exist")
    if plot is not None:
        check_plot_path(plot)
    if result_dir is not None and not result_dir.is_dir():
        raise UserError(f"--result-dir {result_dir}: no such folder")
    return ReportOptions(points, slos or None, gates, save_result, plot, tuple(computed), csv, max_failure_rate,
                         label, dict(_pairs(metadata or [], "--metadata")), latency_metrics, result_dir)


def _pairs(values: list[str], flag: str) -> tuple[tuple[str, str], ...]:
    """['K=V', ...] -> (('K', 'V'), ...); a value may itself hold '='."""
    from llmctl.errors import UserError

    pairs = []
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key.strip():
            raise UserError(f"{flag} {value!r}: expected KEY=VALUE")
        pairs.append((key.strip(), rest))
    return tuple(pairs)


def _extra_body(text: Optional[str]) -> Optional[dict[str, Any]]:
    import json

    from llmctl.errors import UserError

    if text is None:
        return None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--extra-body is not valid JSON ({exc.msg})") from None
    if not isinstance(body, dict):
        raise UserError("--extra-body must be a JSON object, e.g. '{\"top_p\": 0.9}'")
    return body


def _sweep(request_rate: str, max_concurrency: Optional[str]) -> tuple[list[float], list[Optional[int]]]:
    from llmctl.bench.sweep import parse_concurrencies, parse_rates

    try:
        rates = parse_rates(request_rate)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--request-rate")
    try:
        return rates, parse_concurrencies(max_concurrency)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--max-concurrency")


def _plan(request_rate: float, burstiness: float, max_concurrency: Optional[int], seed: int,
          ignore_eos: bool, temperature: float, duration: Optional[float], ramp_up: float, request_id_prefix: str):
    from llmctl.bench.arrivals import validate_rate
    from llmctl.bench.serve_load import LoadPlan

    try:
        validate_rate(request_rate, burstiness)
    except ValueError as exc:
        hint = "--request-rate" if "rate" in str(exc) else "--burstiness"
        raise typer.BadParameter(str(exc), param_hint=hint)
    return LoadPlan(request_rate, burstiness, max_concurrency, seed, ignore_eos, temperature, duration, ramp_up,
                    request_id_prefix)


def _check_dataset_flags(dataset: DatasetName, path: Optional[Path], range_ratio: float,
                         endpoint: Optional[Endpoint], request_rate: str) -> None:
    from llmctl.bench import datasets
    from llmctl.bench.serve_runner import CHAT_DATASETS
    from llmctl.errors import UserError

    datasets.validate_range_ratio(range_ratio)
    needs_file = dataset not in (DatasetName.random, DatasetName.shared_prefix)
    if needs_file and path is None:
        raise UserError(f"--dataset-name {dataset.value} needs --dataset-path FILE")
    if not needs_file and path is not None:
        raise UserError(f"--dataset-path is not read with --dataset-name {dataset.value}")
    if dataset.value in CHAT_DATASETS and endpoint is Endpoint.completions:
        raise UserError(f"--dataset-name {dataset.value} holds chat messages: use --endpoint chat")
    if dataset is DatasetName.trace and request_rate.strip() != "inf":
        raise UserError("--dataset-name trace sends each request at its timestamp: drop --request-rate")
