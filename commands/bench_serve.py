"""`llmctl bench serve`: load-test any OpenAI-compatible server and report vLLM's serving metrics.

Parses and checks every flag before the first request, builds the prompts (`llmctl.bench.datasets`),
runs the load (`llmctl.bench.serve_load`) under a live progress bar on a TTY, then prints the result
block (or `--json`), saves or plots it, and turns `--slo` gates and total failure into exit code 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmctl.config import ConfigOption

LOAD = "Load"
DATA = "Dataset"
REPORT = "Report"


class Endpoint(str, Enum):
    completions = "completions"
    chat = "chat"


class DatasetName(str, Enum):
    random = "random"
    file = "file"
    shared_prefix = "shared-prefix"


def _o(*names: str, panel: str, **kwargs: Any):
    return typer.Option(*names, rich_help_panel=panel, **kwargs)


def serve(
    base_url: Annotated[str, typer.Option("--base-url", help="Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine).")] = "http://127.0.0.1:8000",
    endpoint: Annotated[Endpoint, typer.Option("--endpoint", help="/v1/completions or /v1/chat/completions.")] = Endpoint.completions,
    model: Annotated[Optional[str], typer.Option("--model", envvar="LLMCTL_BENCH_SERVE_MODEL", help="Model name to request (default: the first id of GET /v1/models).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Bearer token (default: $OPENAI_API_KEY).")] = None,
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
    from llmctl.bench import serve_load
    from llmctl.bench.cost import check_cost_flags
    from llmctl.bench.metrics import check_slos

    report = _report_options(percentiles, goodput, slo, save_result, plot)
    check_cost_flags(price_per_hour, monthly_request_rate)
    plan = _plan(request_rate, burstiness, max_concurrency, seed, ignore_eos, temperature)
    base = serve_load.normalize_base_url(base_url)
    _check_dataset_flags(dataset, dataset_path, random_range_ratio)
    tok = _load_tokenizer(tokenizer)
    key = api_key or os.environ.get("OPENAI_API_KEY") or None
    served = serve_load.served_model(base, key, model)
    if tok is None and (tokenizer := _served_tokenizer_folder(served.id)) is not None:
        tok = _load_tokenizer(tokenizer)
    shape = _Shape(dataset, dataset_path, num_prompts + num_warmups, random_input_len, random_output_len,
                   random_range_ratio, prefix_len, num_prefixes, seed)
    prompts = _fitted_prompts(shape, tok, served.max_model_len, endpoint is Endpoint.chat)
    target = serve_load.Target(base, endpoint.value, served.id, key, request_timeout)
    run = _run(target, plan, prompts[num_warmups:], prompts[:num_warmups], tok)
    settings = _settings(target, plan, dataset.value, num_prompts, num_warmups, tokenizer, report)
    settings["max_model_len"] = served.max_model_len
    document = serve_load.result_document(settings, run, report["percentiles"], report["goodput"], save_detailed)
    if price_per_hour is not None:
        document["cost"] = _cost(document, price_per_hour, monthly_request_rate)
    if report["gates"]:
        document["slo"] = check_slos(report["gates"], document)
    _emit(document, report, json_output, run, target)
    raise typer.Exit(_exit_code(document))


# ---- flag checks ---------------------------------------------------------------------------------

def _report_options(percentiles: str, goodput: Optional[list[str]], slo: Optional[list[str]],
                    save_result: Optional[Path], plot: Optional[Path]) -> dict[str, Any]:
    from llmctl.bench.metrics import metric_keys, parse_goodput, parse_percentiles, parse_slo
    from llmctl.bench.plot import check_plot_path
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
    return {"percentiles": points, "goodput": slos or None, "gates": gates, "save_result": save_result, "plot": plot}


def _cost(document: dict[str, Any], price_per_hour: float, monthly_request_rate: Optional[float]) -> dict[str, Any]:
    from llmctl.bench.cost import cost_figures

    return cost_figures(price_per_hour, requests_per_s=document["request_throughput"],
                        output_tokens_per_s=document["output_throughput"],
                        total_tokens_per_s=document["total_token_throughput"],
                        monthly_request_rate=monthly_request_rate)


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


def _load_tokenizer(folder: Optional[Path]):
    if folder is None:
        return None
    from llmctl.engine.tokenizer import Tokenizer
    from llmctl.errors import UserError

    if not (folder / "tokenizer.json").is_file():
        raise UserError(f"--tokenizer {folder}: no tokenizer.json there (give the model's folder)")
    try:
        return Tokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - ModelLoadError and friends all mean the same to the user
        raise UserError(f"--tokenizer {folder}: {exc}") from None


def _check_dataset_flags(dataset: DatasetName, path: Optional[Path], range_ratio: float) -> None:
    from llmctl.bench import datasets
    from llmctl.errors import UserError

    datasets.validate_range_ratio(range_ratio)
    if dataset is DatasetName.file and path is None:
        raise UserError("--dataset file needs --dataset-path FILE.jsonl")
    if dataset is not DatasetName.file and path is not None:
        raise UserError(f"--dataset-path is only read with --dataset file (not {dataset.value})")


def _served_tokenizer_folder(model_id: str) -> Optional[Path]:
    """The served model's tokenizer when this machine has it: the embedded model's, or a folder named
    like the model id (vLLM's bench serve likewise loads the tokenizer named by the model)."""
    from llmctl.engine_options import EMBEDDED_MODEL_ID

    if model_id == EMBEDDED_MODEL_ID:
        from llmctl.engine.llm_engine import default_model_path

        return default_model_path()
    folder = Path(model_id).expanduser()
    return folder if (folder / "tokenizer.json").is_file() else None


@dataclass(frozen=True)
class _Shape:
    dataset: DatasetName
    path: Optional[Path]
    count: int
    input_len: int
    output_len: int
    range_ratio: float
    prefix_len: int
    num_prefixes: int
    seed: int


def _fitted_prompts(shape: _Shape, tok, max_model_len: Optional[int], chat: bool):
    """The prompts, fitted into the server's context (prompt + output <= max_model_len) with a warning."""
    from dataclasses import replace

    from llmctl.bench import datasets

    if max_model_len is None:
        return _prompts(shape, tok)
    context = max_model_len - (datasets.added_tokens(tok, chat) if tok is not None else 0)
    unit = "tokens" if tok is not None else "words (no --tokenizer: they may tokenize longer)"
    if shape.dataset is not DatasetName.file:
        prefix = shape.prefix_len if shape.dataset is DatasetName.shared_prefix else 0
        input_len, output_len, prefix_len = datasets.fit_lengths(shape.input_len, shape.output_len,
                                                                 shape.range_ratio, context, prefix)
        if (input_len, output_len, prefix_len) != (shape.input_len, shape.output_len, prefix):
            asked = f"--random-input-len {shape.input_len} + --random-output-len {shape.output_len}"
            asked += f" + --prefix-len {prefix}" if prefix else ""
            _warn(f"{asked} do not fit the server's max_model_len of {max_model_len}: sending "
                  f"{input_len}{f' + {prefix_len} prefix' if prefix else ''} prompt and {output_len} output {unit}")
            shape = replace(shape, input_len=input_len, output_len=output_len, prefix_len=prefix_len or shape.prefix_len)
    prompts, capped, too_long = datasets.fit_requests(_prompts(shape, tok), context)
    if capped:
        _warn(f"{capped} request(s) asked for more output than fits the server's max_model_len of "
              f"{max_model_len} after the prompt: their max_tokens were lowered")
    if too_long:
        _warn(f"{too_long} prompt(s) alone fill the server's max_model_len of {max_model_len}; "
              "the server will refuse them")
    return prompts


def _warn(message: str) -> None:
    typer.echo(f"llmctl: warning: {message}", err=True)


def _prompts(shape: _Shape, tok):
    import numpy as np

    from llmctl.bench import datasets

    rng = np.random.default_rng([shape.seed, 0])
    if shape.dataset is DatasetName.file:
        return datasets.file_requests(shape.path, shape.count, shape.output_len, tok)
    if shape.dataset is DatasetName.shared_prefix:
        return datasets.shared_prefix_requests(shape.count, shape.num_prefixes, shape.prefix_len, shape.input_len,
                                               shape.output_len, shape.range_ratio, rng, tok)
    return datasets.random_requests(shape.count, shape.input_len, shape.output_len, shape.range_ratio, rng, tok)


# ---- running ---------------------------------------------------------------------------------------

def _run(target, plan, requests, warmups, tok):
    from llmctl.bench.serve_load import run_load
    from llmctl.output import is_interactive, stderr_console

    err = stderr_console()
    if not is_interactive(err):
        return run_load(target, plan, requests, warmups, tok)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    failed = {"warmup": 0, "bench": 0}
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("[red]{task.fields[failed]} failed"), TimeElapsedColumn())
    rate = "all at once" if plan.request_rate == float("inf") else f"{plan.request_rate:g} req/s"
    err.print(f"[bold]{target.model}[/bold] @ {target.url}: {len(requests)} requests, {rate}", markup=True)
    with Progress(*columns, console=err, transient=True) as progress:
        tasks = {}
        if warmups:
            tasks["warmup"] = progress.add_task("warm-up", total=len(warmups), failed=0)
        tasks["bench"] = progress.add_task("benchmark", total=len(requests), failed=0)

        def observe(phase: str, outcome) -> None:
            failed[phase] += not outcome.success
            progress.update(tasks[phase], advance=1, failed=failed[phase])

        return run_load(target, plan, requests, warmups, tok, observe)


def _settings(target, plan, dataset: str, num_prompts: int, num_warmups: int, tokenizer: Optional[Path],
              report: dict[str, Any]) -> dict[str, Any]:
    import math
    from datetime import datetime, timezone

    from llmctl.__about__ import __version__
    from llmctl.bench.serve_load import ENDPOINT_PATHS

    return {
        "schema_version": 1,
        "llmctl_version": __version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": target.base_url,
        "endpoint": ENDPOINT_PATHS[target.endpoint],
        "model_id": target.model,
        "dataset_name": dataset,
        "num_prompts": num_prompts,
        "num_warmups": num_warmups,
        # JSON has no infinity; vLLM writes the string "inf" too.
        "request_rate": "inf" if math.isinf(plan.request_rate) else plan.request_rate,
        "burstiness": plan.burstiness,
        "max_concurrency": plan.max_concurrency,
        "seed": plan.seed,
        "ignore_eos": plan.ignore_eos,
        "tokenizer": str(tokenizer) if tokenizer else None,
        "percentiles": report["percentiles"],
        "goodput_slos_ms": report["goodput"],
    }


# ---- reporting -----------------------------------------------------------------------------------

def _emit(document: dict[str, Any], report: dict[str, Any], json_output: bool, run, target) -> None:
    from llmctl.output import print_json

    if json_output:
        print_json(document)
    else:
        _print_summary(document, report["percentiles"])
    if report["save_result"] is not None:
        _save(report["save_result"], document)
    if report["plot"] is not None:
        from llmctl.bench.plot import write_plot

        write_plot(report["plot"], run.outcomes, f"{target.model} @ {target.url} ({document['completed']} requests)")
    _print_problems(document)


def _save(path: Path, document: dict[str, Any]) -> None:
    from llmctl.errors import UserError
    from llmctl.output import print_json

    try:
        with path.open("w") as stream:
            print_json(document, stream=stream)
    except OSError as exc:
        raise UserError(f"cannot write --save-result {path}: {exc.strerror or exc}") from None


def _print_summary(document: dict[str, Any], percentiles: list[float]) -> None:
    from llmctl.bench.metrics import summary_rows
    from llmctl.output import stdout_console

    rows = summary_rows(document, percentiles)
    if "cost" in document:
        from llmctl.bench.cost import cost_rows

        rows += cost_rows(document["cost"])
    console = stdout_console()
    if console.is_terminal:
        from rich.table import Table

        table = Table(title="Serving Benchmark Result", show_header=False)
        table.add_column("metric")
        table.add_column("value", justify="right")
        for label, value in rows:
            if value is None:
                table.add_section()
                table.add_row(f"[bold]{label}[/bold]", "")
            else:
                table.add_row(label, value)
        console.print(table)
        return
    typer.echo("{s:=^50}".format(s=" Serving Benchmark Result "))
    for label, value in rows:
        typer.echo("{s:-^50}".format(s=label) if value is None else f"{label + ':':<40}{value}")
    typer.echo("=" * 50)


def _print_problems(document: dict[str, Any]) -> None:
    import sys

    for sample in document["error_samples"]:
        status = "no response" if sample["status"] is None else f"HTTP {sample['status']}"
        sys.stderr.write(f"llmctl: {sample['count']} request(s) failed: {status}: {sample['message']}\n")
    for gate in document.get("slo", []):
        measured = "not measured" if gate["value"] is None else f"measured {gate['value']:.6g}"
        verdict = "passed" if gate["passed"] else "violated"
        sys.stderr.write(f"llmctl: slo {verdict}: {gate['gate']} ({measured})\n")
    if document["completed"] == 0:
        sys.stderr.write(f"llmctl: error: all {document['failed']} requests failed\n")


def _exit_code(document: dict[str, Any]) -> int:
    if document["completed"] == 0:
        return 1
    return 0 if all(gate["passed"] for gate in document.get("slo", [])) else 1
