"""What `llmctl bench serve` does once its flags are parsed: ask the server for its model, find a
tokenizer, build the prompts fitted into the server's context (`datasets`), run the load under a
live progress bar on a TTY (`serve_load`), then build the result document (settings, vLLM's
metrics, cost, `--slo` verdicts), print, save and plot it, and return the exit code."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from llmctl.bench import datasets, serve_load
from llmctl.bench.client import ENDPOINT_PATHS
from llmctl.errors import UserError

@dataclass(frozen=True)
class PromptShape:
    dataset: str  # "random", "file" or "shared-prefix"
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
    percentiles: list[float]
    goodput: Optional[dict[str, float]]
    gates: list[Any]
    save_result: Optional[Path]
    plot: Optional[Path]


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
    tokenizer: Optional[Path]
    report: ReportOptions
    save_detailed: bool
    json_output: bool
    price_per_hour: Optional[float] = None
    monthly_request_rate: Optional[float] = None


def run_serve_bench(job: ServeBenchJob) -> int:
    """Run the benchmark, print the report; 1 when every request failed or a gate was violated."""
    from llmctl.bench.metrics import check_slos

    tok = load_tokenizer(job.tokenizer)
    served = serve_load.served_model(job.base_url, job.api_key, job.model)
    tokenizer = job.tokenizer
    if tok is None and (tokenizer := served_tokenizer_folder(served.id)) is not None:
        tok = load_tokenizer(tokenizer)
    prompts = fitted_prompts(job.shape, tok, served.max_model_len, job.endpoint == "chat")
    target = serve_load.Target(job.base_url, job.endpoint, served.id, job.api_key, job.request_timeout)
    run = _run(target, job.plan, prompts[job.num_warmups:], prompts[:job.num_warmups], tok)
    settings = _settings(target, job, tokenizer)
    settings["max_model_len"] = served.max_model_len
    document = serve_load.result_document(settings, run, job.report.percentiles, job.report.goodput,
                                          job.save_detailed)
    if job.price_per_hour is not None:
        document["cost"] = _cost(document, job.price_per_hour, job.monthly_request_rate)
    if job.report.gates:
        document["slo"] = check_slos(job.report.gates, document)
    _emit(document, job, run, target)
    return exit_code(document)


def load_tokenizer(folder: Optional[Path]):
    if folder is None:
        return None
    from llmctl.engine.tokenizer import Tokenizer

    if not (folder / "tokenizer.json").is_file():
        raise UserError(f"--tokenizer {folder}: no tokenizer.json there (give the model's folder)")
    try:
        return Tokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - ModelLoadError and friends all mean the same to the user
        raise UserError(f"--tokenizer {folder}: {exc}") from None


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
    if shape.dataset != "file":
        prefix = shape.prefix_len if shape.dataset == "shared-prefix" else 0
        input_len, output_len, prefix_len = datasets.fit_lengths(shape.input_len, shape.output_len,
                                                                 shape.range_ratio, context, prefix)
        if (input_len, output_len, prefix_len) != (shape.input_len, shape.output_len, prefix):
            asked = f"--random-input-len {shape.input_len} + --random-output-len {shape.output_len}"
            asked += f" + --prefix-len {prefix}" if prefix else ""
            _warn(f"{asked} do not fit the server's max_model_len of {max_model_len}: sending "
                  f"{input_len}{f' + {prefix_len} prefix' if prefix else ''} prompt and {output_len} output {unit}")
            shape = replace(shape, input_len=input_len, output_len=output_len, prefix_len=prefix_len or shape.prefix_len)
    prompts, capped, too_long = datasets.fit_requests(build_prompts(shape, tok), context)
    if capped:
        _warn(f"{capped} request(s) asked for more output than fits the server's max_model_len of "
              f"{max_model_len} after the prompt: their max_tokens were lowered")
    if too_long:
        _warn(f"{too_long} prompt(s) alone fill the server's max_model_len of {max_model_len}; "
              "the server will refuse them")
    return prompts


def build_prompts(shape: PromptShape, tok):
    import numpy as np

    rng = np.random.default_rng([shape.seed, 0])
    if shape.dataset == "file":
        return datasets.file_requests(shape.path, shape.count, shape.output_len, tok)
    if shape.dataset == "shared-prefix":
        return datasets.shared_prefix_requests(shape.count, shape.num_prefixes, shape.prefix_len, shape.input_len,
                                               shape.output_len, shape.range_ratio, rng, tok)
    return datasets.random_requests(shape.count, shape.input_len, shape.output_len, shape.range_ratio, rng, tok)


def _warn(message: str) -> None:
    import sys

    sys.stderr.write(f"llmctl: warning: {message}\n")


def _run(target, plan, requests, warmups, tok):
    from llmctl.bench.report import load_progress

    with load_progress(target, plan, len(requests), len(warmups)) as observe:
        return serve_load.run_load(target, plan, requests, warmups, tok, observe)


def _settings(target: serve_load.Target, job: ServeBenchJob, tokenizer: Optional[Path]) -> dict[str, Any]:
    from llmctl.__about__ import __version__

    plan = job.plan
    return {
        "schema_version": 1,
        "llmctl_version": __version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": target.base_url,
        "endpoint": ENDPOINT_PATHS[target.endpoint],
        "model_id": target.model,
        "dataset_name": job.shape.dataset,
        "num_prompts": job.num_prompts,
        "num_warmups": job.num_warmups,
        # JSON has no infinity; vLLM writes the string "inf" too.
        "request_rate": "inf" if math.isinf(plan.request_rate) else plan.request_rate,
        "burstiness": plan.burstiness,
        "max_concurrency": plan.max_concurrency,
        "seed": plan.seed,
        "ignore_eos": plan.ignore_eos,
        "tokenizer": str(tokenizer) if tokenizer else None,
        "percentiles": job.report.percentiles,
        "goodput_slos_ms": job.report.goodput,
    }


def _cost(document: dict[str, Any], price_per_hour: float, monthly_request_rate: Optional[float]) -> dict[str, Any]:
    from llmctl.bench.cost import cost_figures

    return cost_figures(price_per_hour, requests_per_s=document["request_throughput"],
                        output_tokens_per_s=document["output_throughput"],
                        total_tokens_per_s=document["total_token_throughput"],
                        monthly_request_rate=monthly_request_rate)


def _emit(document: dict[str, Any], job: ServeBenchJob, run, target) -> None:
    from llmctl.bench.report import print_serve_problems, render_serve
    from llmctl.output import print_json

    if job.json_output:
        print_json(document)
    else:
        render_serve(document, job.report.percentiles)
    if job.report.save_result is not None:
        _save(job.report.save_result, document)
    if job.report.plot is not None:
        from llmctl.bench.plot import write_plot

        write_plot(job.report.plot, run.outcomes,
                   f"{target.model} @ {target.url} ({document['completed']} requests)")
    print_serve_problems(document)


def _save(path: Path, document: dict[str, Any]) -> None:
    from llmctl.output import print_json

    try:
        with path.open("w") as stream:
            print_json(document, stream=stream)
    except OSError as exc:
        raise UserError(f"cannot write --save-result {path}: {exc.strerror or exc}") from None


def exit_code(document: dict[str, Any]) -> int:
    if document["completed"] == 0:
        return 1
    return 0 if all(gate["passed"] for gate in document.get("slo", [])) else 1
