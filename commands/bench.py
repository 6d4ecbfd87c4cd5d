"""`llmctl bench`: hardware microbenchmarks (the group itself, `--gpu`/`--cpu`) and the offline
engine benchmarks `bench throughput` and `bench latency`. Libraries: `llmctl.bench.*`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmctl import engine_options as eo
from llmctl import help as help_format
from llmctl.config import ConfigOption

HARDWARE_FLAGS = ("gpu", "cpu", "quick", "full", "model", "num_threads", "json_output", "fail_below", "stress")
WORKLOAD = "Workload"

bench_app = typer.Typer(
    cls=help_format.Group,
    invoke_without_command=True,
    no_args_is_help=False,
    help="Benchmarks: hardware (default: GPU if present, else CPU), offline throughput and latency.",
    context_settings={"help_option_names": ["-h", "--help"]},
)


@bench_app.callback()
def bench(
    ctx: typer.Context,
    gpu: Annotated[bool, typer.Option("--gpu", help="Benchmark every visible CUDA GPU (error when there is none).")] = False,
    cpu: Annotated[bool, typer.Option("--cpu", help="Benchmark the CPU.")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="Few repetitions and small shapes: a few seconds per device.")] = False,
    full: Annotated[bool, typer.Option("--full", help="Many repetitions and larger shapes.")] = False,
    model: Annotated[Optional[str], typer.Option("--model", "-m", envvar="LLMCTL_BENCH_MODEL", help="Shape of the decode-step benchmark: a model folder (config.json) or a built-in shape (llama-3-8b, mistral-7b, qwen2.5-7b, qwen2.5-0.5b, smollm-135m).")] = None,
    num_threads: eo.engine_flag("num_threads", min=1) = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (nothing else).")] = False,
    fail_below: Annotated[Optional[float], typer.Option("--fail-below", min=0.0, max=100.0, metavar="PCT", help="Exit 1 when any figure with a datasheet peak is under PCT % of it.")] = None,
    stress: Annotated[Optional[str], typer.Option("--stress", metavar="DURATION", help="Instead of the microbenchmarks: checked fp32 GEMMs on every GPU for DURATION (60, 90s, 5m), gpu-burn style, with clocks, temperature, power and throttle reasons per figure; wrong results, new XIDs or ECC errors exit 1.")] = None,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Hardware microbenchmarks with datasheet peaks; subcommands benchmark the engine.

    Exit codes: 0 = done; 1 = a figure is under --fail-below or a benchmark failed; 2 = usage error.
    """
    from llmctl.errors import UserError

    if ctx.invoked_subcommand is not None:
        given = [f"--{n.replace('_output', '').replace('_', '-')}" for n in HARDWARE_FLAGS if _from_cli(ctx, n)]
        if given:
            raise UserError(f"{', '.join(given)} belong(s) to the hardware benchmark ('llmctl bench'), "
                            f"not to 'bench {ctx.invoked_subcommand}'")
        return
    if gpu and cpu:
        raise UserError("give --gpu or --cpu, not both")
    if quick and full:
        raise UserError("give --quick or --full, not both")
    from llmctl.bench.hardware_runner import HardwareJob, run_hardware_job
    from llmctl.bench.stress import parse_duration

    try:
        stress_s = parse_duration(stress) if stress is not None else None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    mode = "quick" if quick else "full" if full else "default"
    raise typer.Exit(run_hardware_job(HardwareJob(gpu, cpu, mode, model, num_threads, json_output, fail_below,
                                                  stress_s)))


def _from_cli(ctx: typer.Context, name: str) -> bool:
    from typer._click.core import ParameterSource

    return ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE


# ---- offline: throughput and latency ------------------------------------------------------------
def _w(*names: str, help: str, **extra: Any) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=WORKLOAD, **extra)


@bench_app.command("throughput", cls=help_format.Command)
@eo.with_engine_flags(enable_prefix_caching=False)
def throughput(
    num_prompts: Annotated[Optional[int], _w("--num-prompts", min=1, help="Requests in the pass (default: 100 random; a dataset's all).")] = None,
    input_len: Annotated[int, _w("--input-len", help="Prompt tokens per random request.")] = 128,
    output_len: Annotated[int, _w("--output-len", help="Output tokens per request (exact: ignore_eos).")] = 128,
    range_ratio: Annotated[float, _w("--range-ratio", help="Random lengths uniform in [L(1-r), L(1+r)], 0 <= r < 1.")] = 0.0,
    dataset: Annotated[Optional[Path], _w("--dataset", envvar="LLMCTL_BENCH_THROUGHPUT_DATASET", help="Prompts file (plain lines or JSON lines as for 'generate -f') instead of random prompts.", dir_okay=False)] = None,
    repeats: Annotated[int, _w("--repeats", min=1, help="Timed passes (mean ± std over them).")] = 1,
    workload_seed: Annotated[int, _w("--workload-seed", help="Seed of the random prompts.")] = 0,
    compare_hf: Annotated[bool, _w("--compare-hf", help="Also run transformers generate on the same workload and print the ratio.")] = False,
    hf_batch_size: Annotated[int, _w("--hf-batch-size", min=1, help="Prompts per padded transformers batch.")] = 16,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (nothing else).")] = False,
    price_per_hour: Annotated[Optional[float], typer.Option("--price-per-hour", metavar="USD", help="Instance price: adds USD per 1M output/total tokens and per month (compute only).")] = None,
    monthly_request_rate: Annotated[Optional[float], typer.Option("--monthly-request-rate", metavar="REQ_PER_S", help="Request rate the monthly cost is for (default: the measured one).")] = None,
    engine_args: eo.EngineArgs = eo.FLAGS,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Offline throughput (vLLM's definition): one timed pass over N requests submitted at once."""
    from llmctl.bench.cost import check_cost_flags
    from llmctl.bench.offline_runner import ThroughputJob, run_throughput_job

    check_cost_flags(price_per_hour, monthly_request_rate)
    run_throughput_job(engine_args, ThroughputJob(num_prompts, input_len, output_len, range_ratio, dataset, repeats,
                                           workload_seed, compare_hf, hf_batch_size, json_output,
                                           price_per_hour, monthly_request_rate))


@bench_app.command("latency", cls=help_format.Command)
@eo.with_engine_flags(enable_prefix_caching=False)
def latency(
    batch_size: Annotated[int, _w("--batch-size", min=1, help="Prompts in the batch.")] = 8,
    input_len: Annotated[int, _w("--input-len", help="Prompt tokens per request.")] = 32,
    output_len: Annotated[int, _w("--output-len", help="Output tokens per request (exact: ignore_eos).")] = 128,
    num_iters_warmup: Annotated[int, _w("--num-iters-warmup", min=0, help="Untimed passes first.")] = 10,
    num_iters: Annotated[int, _w("--num-iters", min=1, help="Timed passes.")] = 30,
    workload_seed: Annotated[int, _w("--workload-seed", help="Seed of the random prompts.")] = 0,
    compare_hf: Annotated[bool, _w("--compare-hf", help="Also time transformers generate on the same batch and print the ratio.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (nothing else).")] = False,
    engine_args: eo.EngineArgs = eo.FLAGS,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Offline latency (vLLM's definition): one fixed batch end to end, warm-up then timed passes."""
    from llmctl.bench.offline_runner import LatencyJob, run_latency_job

    run_latency_job(engine_args, LatencyJob(batch_size, input_len, output_len, num_iters_warmup, num_iters, workload_seed,
                                     compare_hf, json_output))


def _register_serve() -> None:
    from llmctl.commands import bench_serve

    bench_app.command("serve", cls=help_format.Command)(bench_serve.serve)


_register_serve()
