"""`llmctl bench serve`: load-test any OpenAI-compatible server and report vLLM's serving metrics.

Parses and checks every flag before the first request; `llmctl.bench.serve_runner` then runs the
load and reports it (exit 1 on a violated `--slo` gate or when every request failed).
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


def _o(*names: str, panel: str, **kwargs: Any):
    return typer.Option(*names, rich_help_panel=panel, **kwargs)


def serve(
    base_url: Annotated[str, typer.Option("--base-url", help="Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine).")] = "http://127.0.0.1:8000",
    endpoint: Annotated[Endpoint, typer.Option("--endpoint", help=ENDPOINT_HELP)] = Endpoint.completions,
    model: Annotated[Optional[str], typer.Option("--model", envvar="LLMCTL_BENCH_SERVE_MODEL", help="Model name to request (default: the first id of GET /v1/models).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help=API_KEY_HELP)] = None,
    request_rate: Annotated[float, _o("--request-rate", panel=LOAD, help="Requests per second; inf sends all at once.")] = float("inf"),
    burstiness: Annotated[float, _o("--burstiness", panel=LOAD, help="Gamma shape of the arrivals: 1 = Poisson, < 1 burstier, > 1 steadier.")] = 1.0,
    max_concurrency: Annotated[Optional[int], _o("--max-concurrency", panel=LOAD, min=1, help="Most requests in flight at once (default: no limit).")] = None,
    num_prompts: Annotated[int, _o("--num-prompts", panel=LOAD, min=1, help="Timed requests to send.")] = 1000,
    num_warmups: Annotated[int, _o("--num-warmups", panel=LOAD, min=0, help="Untimed requests sent (and finished) before the benchmark.")] = 0,
    seed: Annotated[int, _o("--seed", panel=LOAD, envvar="LLMCTL_BENCH_SERVE_SEED", help="Seed of the prompts and of the arrival times.")] = 0,
    ignore_eos: Annotated[bool, _o("--ignore-eos/--no-ignore-eos", panel=LOAD, help="Ask for exactly max_tokens (vLLM's ignore_eos extension).")] = True,
    temperature: Annotated[float, _o("--temperature", panel=LOAD, min=0.0, help="Sampling temperature sent with each request.")] = 0.0,
    request_timeout: Annotated[float, _o("--request-timeout", panel=LOAD, envvar="LLMCTL_BENCH_SERVE_REQUEST_TIMEOUT", min=0.001, help="Seconds without a byte from the server before a request fails.")] = 600.0,
    dataset: Annotated[DatasetName, _o("--dataset", panel=DATA, envvar="LLMCTL_BENCH_SERVE_DATASET", help="random, file (--dataset-path JSONL) or shared-prefix.")] = DatasetName.random,
    dataset_path: Annotated[Optional[Path], _o("--dataset-path", panel=DATA, dir_okay=False, help="JSON lines with 'prompt' and optional 'output_len' or 'max_tokens'.")] = None,
    random_input_len: Annotated[int, _o("--random-input-len", panel=DATA, min=1, help="Prompt tokens (random; the suffix for shared-prefix).")] = 1024,
    random_output_len: Annotated[int, _o("--random-output-len", panel=DATA, min=1, help="Output tokens (max_tokens); also the default for file prompts.")] = 128,
    random_range_ratio: Annotated[float, _o("--random-range-ratio", panel=DATA, help="Lengths uniform in [L(1-r), L(1+r)], 0 <= r < 1.")] = 0.0,
    prefix_len: Annotated[int, _o("--prefix-len", panel=DATA, min=1, help="shared-prefix: tokens of the prefix each group shares.")] = 256,
    num_prefixes: Annotated[int, _o("--num-prefixes", panel=DATA, min=1, help="shared-prefix: number of distinct prefixes (groups).")] = 10,
    tokenizer: Annotated[Optional[Path], _o("--tokenizer", panel=DATA, file_okay=False, help="Folder with tokenizer.json: exact prompt lengths and a token count fallback.")] = None,
    percentiles: Annotated[str, _o("--percentiles", panel=REPORT, help="Percentiles reported for TTFT, TPOT, ITL and E2EL.")] = "50,90,99",
    goodput: Annotated[Optional[list[str]], _o("--goodput", panel=REPORT, metavar="KEY:MS", help="Per-request SLOs for goodput: ttft:MS tpot:MS e2el:MS (repeatable).")] = None,
    slo: Annotated[Optional[list[str]], _o("--slo", panel=REPORT, metavar="EXPR", help="Gate such as 'p99_ttft_ms<500' (repeatable; < <= > >=); exit 1 when violated.")] = None,
    json_output: Annotated[bool, _o("--json", panel=REPORT, help="Print only the result document as JSON on stdout.")] = False,
    save_result: Annotated[Optional[Path], _o("--save-result", panel=REPORT, dir_okay=False, help="Also write the JSON result document to this file.")] = None,
    save_detailed: Annotated[bool, _o("--save-detailed", panel=REPORT, help="Add per-request lengths, times, texts and errors to the JSON.")] = False,
    plot: Annotated[Optional[Path], _o("--plot", panel=REPORT, dir_okay=False, help="Write latency histograms and throughput over time (.png, .svg, .pdf).")] = None,
    price_per_hour: Annotated[Optional[float], _o("--price-per-hour", panel=REPORT, metavar="USD", help="Instance price: adds USD per 1M output/total tokens and per month (compute only).")] = None,
    monthly_request_rate: Annotated[Optional[float], _o("--monthly-request-rate", panel=REPORT, metavar="REQ_PER_S", help="Request rate the monthly cost is for (default: the measured one).")] = None,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Benchmark an OpenAI-compatible server under load: TTFT, TPOT, ITL, E2E latency, throughput, goodput.

    Exit codes: 0 = done and every --slo gate held; 1 = a gate was violated or every request failed;
    2 = usage error or unreachable server.

    Example: llmctl bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 --slo 'p99_ttft_ms<500'
    """
    from llmctl.bench import client, serve_load
    from llmctl.bench.cost import check_cost_flags
    from llmctl.bench.serve_runner import PromptShape, ServeBenchJob, run_serve_bench

    report = _report_options(percentiles, goodput, slo, save_result, plot)
    check_cost_flags(price_per_hour, monthly_request_rate)
    plan = _plan(request_rate, burstiness, max_concurrency, seed, ignore_eos, temperature)
    base = serve_load.normalize_base_url(base_url)
    _check_dataset_flags(dataset, dataset_path, random_range_ratio)
    shape = PromptShape(dataset.value, dataset_path, num_prompts + num_warmups, random_input_len, random_output_len,
                        random_range_ratio, prefix_len, num_prefixes, seed)
    job = ServeBenchJob(base, endpoint.value, model, client.api_key(api_key), request_timeout, plan, shape,
                        num_prompts, num_warmups, tokenizer, report, save_detailed, json_output, price_per_hour,
                        monthly_request_rate)
    raise typer.Exit(run_serve_bench(job))


# ---- flag checks ---------------------------------------------------------------------------------

def _report_options(percentiles: str, goodput: Optional[list[str]], slo: Optional[list[str]],
                    save_result: Optional[Path], plot: Optional[Path]):
    from llmctl.bench.metrics import metric_keys, parse_goodput, parse_percentiles, parse_slo
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
    keys = metric_keys(points, with_goodput=bool(slos))
    gates = []
    for text in slo or []:
        if not slos and text.strip().startswith("request_goodput"):
            raise UserError("--slo on request_goodput needs --goodput (the per-request SLOs it counts)")
        try:
            gates.append(parse_slo(text, keys))
        except ValueError as exc:
            raise UserError(f"--slo {exc}") from None
    if save_result is not None and not save_result.resolve().parent.is_dir():
        raise UserError(f"--save-result {save_result}: folder {save_result.resolve().parent} does not exist")
    if plot is not None:
        check_plot_path(plot)
    return ReportOptions(points, slos or None, gates, save_result, plot)


def _plan(request_rate: float, burstiness: float, max_concurrency: Optional[int], seed: int,
          ignore_eos: bool, temperature: float):
    from llmctl.bench.arrivals import validate_rate
    from llmctl.bench.serve_load import LoadPlan

    try:
        validate_rate(request_rate, burstiness)
    except ValueError as exc:
        hint = "--request-rate" if "rate" in str(exc) else "--burstiness"
        raise typer.BadParameter(str(exc), param_hint=hint)
    return LoadPlan(request_rate, burstiness, max_concurrency, seed, ignore_eos, temperature)


def _check_dataset_flags(dataset: DatasetName, path: Optional[Path], range_ratio: float) -> None:
    from llmctl.bench import datasets
    from llmctl.errors import UserError

    datasets.validate_range_ratio(range_ratio)
    if dataset is DatasetName.file and path is None:
        raise UserError("--dataset file needs --dataset-path FILE.jsonl")
    if dataset is not DatasetName.file and path is not None:
        raise UserError(f"--dataset-path is only read with --dataset file (not {dataset.value})")
