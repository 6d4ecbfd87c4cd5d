"""`llmctl profile`: cpu (py-spy), mem (memray), torch (torch.profiler), server (a live `llmctl serve`'s
torch.profiler under a short load), leak (RSS growth + memray) and nsys (Nsight Systems).

Thin: parse and cross-check flags, run preflight, call `llmctl.profiling`, render the manifest.
Every run writes its files and a manifest.json into one folder; `--json` prints only the manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmctl import engine_options as eo
from llmctl import help as help_format
from llmctl.bench.client import API_KEY_HELP, ENDPOINT_HELP, Endpoint
from llmctl.config import ConfigOption, choice_type

profile_app = typer.Typer(
    cls=help_format.Group,
    name="profile",
    help="Profile a workload or a running process: CPU (py-spy), memory (memray), torch ops, a live server, leaks, Nsight Systems.",
    no_args_is_help=True,
)

OUT = "Output"
# Not LLMCTL_PORT: that is the port `serve` listens on, and set for it, it would also make every
# `profile cpu -- CMD` refuse "a workload and --port" (issue 11).
PORT_ENV = "LLMCTL_PROFILE_PORT"
WORKLOAD_PANEL = "Workload"


CpuFormat = choice_type("CpuFormat", ("flamegraph", "speedscope", "chrometrace", "raw"))
MemReport = choice_type("MemReport", ("flamegraph", "table", "summary", "stats"))
SortKey = choice_type("SortKey", ("self_cpu_time_total", "cpu_time_total", "self_device_time_total",
                                  "device_time_total", "count", "self_cpu_memory_usage", "cpu_memory_usage"))


OutputDir = Annotated[Optional[Path], typer.Option("--output-dir", "-o", file_okay=False, rich_help_panel=OUT,
                                                   help="Artifact folder (default: ./llmctl-profiles/<kind>-<YYYYmmdd-HHMMSS>).")]
JsonOut = Annotated[bool, typer.Option("--json", rich_help_panel=OUT, help="Print only the manifest (JSON) on stdout.")]
DryRun = Annotated[bool, typer.Option("--dry-run", rich_help_panel=OUT, help="Print the underlying command and exit.")]
Pid = Annotated[Optional[int], typer.Option("--pid", "-p", help="Attach to this process.")]
Port = Annotated[Optional[int], typer.Option("--port", envvar=PORT_ENV, help="Attach to the process listening on this TCP port (e.g. llmctl serve).")]
Workload = Annotated[Optional[list[str]], typer.Argument(metavar="COMMAND", show_default=False,
                                                         help="Workload to start and profile (after --).")]
BatchSize = Annotated[int, typer.Option("--batch-size", min=1, rich_help_panel=WORKLOAD_PANEL, help="Requests in flight.")]
InputLen = Annotated[int, typer.Option("--input-len", min=1, rich_help_panel=WORKLOAD_PANEL, help="Prompt tokens per request (random ids).")]
OutputLen = Annotated[int, typer.Option("--output-len", min=1, rich_help_panel=WORKLOAD_PANEL, help="Generated tokens per request.")]


@profile_app.command("cpu", cls=help_format.Command)
def cpu(
    workload: Workload = None,
    pid: Pid = None,
    port: Port = None,
    duration: Annotated[Optional[int], typer.Option("--duration", "-d", min=1, help="Seconds to sample (default: until the target exits or Ctrl-C); a workload still running then is stopped.")] = None,
    rate: Annotated[int, typer.Option("--rate", "-r", min=1, max=10000, help="Samples per second.")] = 100,
    format: Annotated[CpuFormat, typer.Option("--format", "-f", help="Profile file format.")] = CpuFormat.flamegraph,
    native: Annotated[bool, typer.Option("--native", help="Include native (C/C++) frames.")] = False,
    subprocesses: Annotated[bool, typer.Option("--subprocesses", help="Also sample the target's child processes.")] = False,
    idle: Annotated[bool, typer.Option("--idle", help="Include idle (waiting) threads.")] = False,
    gil: Annotated[bool, typer.Option("--gil", help="Only samples holding the GIL.")] = False,
    top: Annotated[bool, typer.Option("--top", help="Live top-like view (needs a terminal; writes no files).")] = False,
    dump: Annotated[bool, typer.Option("--dump", help="Print every thread's stack now (with --json: in the manifest).")] = False,
    output_dir: OutputDir = None,
    json_output: JsonOut = False,
    dry_run: DryRun = False,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Sample Python stacks with py-spy: attach (--pid/--port) or run a workload (llmctl profile cpu -- python work.py)."""
    from llmctl.errors import UserError
    from llmctl.profiling import preflight, pyspy, report
    from llmctl.profiling.artifacts import new_manifest

    if top and dump:
        raise UserError("--top and --dump are different modes; pick one")
    if top and json_output:
        raise UserError("--top is a live view; it has no JSON output")
    pyspy_path = preflight.require_pyspy()
    target = preflight.attach_target(pid, port, workload, allow_workload=not dump)
    if workload:
        preflight.require_command(workload)
    plan = pyspy.CpuPlan(pyspy_path, pyspy.Sampling(rate, native, subprocesses, idle, gil), pid=target,
                         workload=workload, duration=duration, fmt=format.value, json_mode=json_output)
    if top:
        _cpu_top(plan, dry_run)
        return
    if dry_run:
        folder = output_dir or Path("<output-dir>")
        command = (pyspy.dump_argv(plan, plan.target_pid_text()) if dump else
                   pyspy.record_argv(plan, plan.target_pid_text(), str(folder / pyspy.OUTPUT_NAMES[plan.fmt])))
        report.print_dry_run(command, workload, json_output)
        return
    manifest = new_manifest("cpu", "py-spy", preflight.tool_version(pyspy_path), output_dir)
    if dump:
        text = pyspy.run_dump(plan, manifest)
        if not json_output and manifest.status == "ok":
            typer.echo(text, nl=False)
        report.finish(manifest, json_output, quiet=True)
        return
    pyspy.run_record(plan, manifest)
    report.finish(manifest, json_output)


def _cpu_top(plan: Any, dry_run: bool) -> None:
    from llmctl.profiling import procs, pyspy, report

    if dry_run:
        report.print_dry_run(pyspy.top_argv(plan, plan.target_pid_text()), plan.workload, False)
        return
    status = pyspy.run_top(plan)
    if plan.workload and status not in (None, 0):
        from llmctl.errors import UserError

        raise UserError(f"the workload failed ({procs.describe_status(status)})", exit_code=1)


@profile_app.command("mem", cls=help_format.Command)
def mem(
    workload: Workload = None,
    pid: Pid = None,
    port: Port = None,
    duration: Annotated[int, typer.Option("--duration", "-d", min=1, help="Seconds to track an attached process.")] = 10,
    report: Annotated[Optional[list[MemReport]], typer.Option("--report", "-r", help="Report to produce (repeatable; default: flamegraph).")] = None,
    leaks: Annotated[bool, typer.Option("--leaks", help="flamegraph/table: show memory not freed by the end instead of the peak.")] = False,
    native: Annotated[bool, typer.Option("--native", help="Record native (C/C++) frames too.")] = False,
    follow_fork: Annotated[bool, typer.Option("--follow-fork", help="Also track processes the workload forks.")] = False,
    trace_python_allocators: Annotated[bool, typer.Option("--trace-python-allocators", help="Record each pymalloc allocation (finer, slower; best with --leaks).")] = False,
    output_dir: OutputDir = None,
    json_output: JsonOut = False,
    dry_run: DryRun = False,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Track allocations with memray: run a Python workload (-- work.py ARGS, -- -m module) or attach to --pid for --duration."""
    from llmctl.errors import UserError
    from llmctl.profiling import memray_tools as mt
    from llmctl.profiling import preflight
    from llmctl.profiling.artifacts import new_manifest
    from llmctl.profiling.report import finish, print_dry_run, print_mem

    reports = [r.value for r in (report or [MemReport.flamegraph])]
    if leaks and not set(reports) & set(mt.LEAK_REPORTS):
        raise UserError("--leaks applies to the flamegraph and table reports")
    version = preflight.require_memray()
    target = preflight.attach_target(pid, port, workload)
    if target is not None:
        preflight.require_debugger()
    plan = mt.MemPlan(pid=target, workload=workload, duration=duration, native=native, follow_fork=follow_fork,
                      trace_python_allocators=trace_python_allocators, reports=list(dict.fromkeys(reports)),
                      leaks=leaks, json_mode=json_output)
    if workload:
        mt.memray_target(workload)  # fail on a non-Python workload before creating anything
    if dry_run:
        folder = output_dir or Path("<output-dir>")
        capture = folder / mt.CAPTURE_NAME
        commands = [mt.capture_argv(plan, capture)] + [
            mt.report_argv(r, capture, folder / mt.REPORT_NAMES[r], leaks and r in mt.LEAK_REPORTS) for r in plan.reports]
        print_dry_run(commands[0], None, json_output, then=commands[1:])
        return
    manifest = new_manifest("mem", "memray", version, output_dir)
    mt.run_capture(plan, manifest)
    if not json_output:
        print_mem(manifest)
    finish(manifest, json_output)


@profile_app.command("torch", cls=help_format.Command)
@eo.with_engine_flags()
def torch_profile(
    ctx: typer.Context,
    batch_size: BatchSize = 4,
    input_len: InputLen = 32,
    output_len: OutputLen = 16,
    steps: Annotated[Optional[int], typer.Option("--steps", min=1, help="Engine steps to run (default: wait + warmup + active).")] = None,
    wait: Annotated[Optional[int], typer.Option("--wait", min=0, help="Schedule: steps run before the profiler starts (default 1).")] = None,
    warmup: Annotated[Optional[int], typer.Option("--warmup", min=0, help="Schedule: steps profiled but discarded (default 1).")] = None,
    active: Annotated[Optional[int], typer.Option("--active", min=1, help="Schedule: steps recorded into the trace (default 3; defaults shrink to fit --steps).")] = None,
    sort_by: Annotated[SortKey, typer.Option("--sort-by", help="Operator table sort key.")] = SortKey.self_cpu_time_total,
    row_limit: Annotated[int, typer.Option("--row-limit", min=1, help="Rows of the operator table.")] = 20,
    record_shapes: Annotated[bool, typer.Option("--record-shapes/--no-record-shapes", help="Record operator input shapes.")] = True,
    with_stack: Annotated[bool, typer.Option("--with-stack", help="Record each op's Python/C++ call stack (larger trace).")] = False,
    profile_memory: Annotated[bool, typer.Option("--profile-memory", help="Record tensor memory allocated and freed per op (memory columns in the table).")] = False,
    with_flops: Annotated[bool, typer.Option("--with-flops", help="Estimate FLOPs of matmul and convolution ops (a FLOP column in the table).")] = False,
    memory_snapshot: Annotated[bool, typer.Option("--memory-snapshot", help="CUDA only: also dump the caching allocator's history to memory_snapshot.pickle (open it at https://pytorch.org/memory_viz).")] = False,
    engine_args: eo.EngineArgs = eo.FLAGS,
    output_dir: OutputDir = None,
    json_output: JsonOut = False,
    dry_run: DryRun = False,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Run engine steps under torch.profiler: Chrome/Perfetto trace (.json.gz) and the operator table."""
    from llmctl.profiling import report
    from llmctl.profiling import torch_trace as tt
    from llmctl.profiling.artifacts import new_manifest, resolved_command

    sched, shrunk = tt.fit_schedule(steps, wait, warmup, active)
    plan = tt.TorchPlan(engine_args, batch_size, input_len, output_len, sched["wait"], sched["warmup"], sched["active"],
                        steps, sort_by.value, row_limit, record_shapes, engine_args.seed, with_stack, profile_memory,
                        with_flops, memory_snapshot)
    plan.validate()
    if shrunk:
        typer.echo(f"llmctl: note: --steps {steps} is shorter than the default schedule; profiling "
                   f"wait {plan.wait} + warmup {plan.warmup} + active {plan.active}", err=True)
    command = resolved_command(ctx)
    if dry_run:
        report.print_dry_run(command, None, json_output)
        return
    import torch

    manifest = new_manifest("torch", "torch.profiler", torch.__version__, output_dir, command=command)
    table = tt.run_torch(plan, manifest)
    if not json_output:
        typer.echo(table)
        typer.echo(f"trace: {manifest.output_dir / tt.TRACE_NAME} (open in https://ui.perfetto.dev)")
        if memory_snapshot:
            typer.echo(f"memory snapshot: {manifest.output_dir / tt.SNAPSHOT_NAME} (open in https://pytorch.org/memory_viz)")
    report.finish(manifest, json_output, quiet=True)


@profile_app.command("leak", cls=help_format.Command)
@eo.with_engine_flags()
def leak(
    ctx: typer.Context,
    workload: Annotated[Optional[str], typer.Argument(metavar="[MODULE:FUNCTION | FILE.py:FUNCTION]", show_default=False,
                                                      help="Callable to run every iteration (no arguments).")] = None,
    engine: Annotated[bool, typer.Option("--engine", help="Run the engine's generate loop instead of a callable.")] = False,
    iterations: Annotated[int, typer.Option("--iterations", "-n", min=1, help="Iterations, warm-up included.")] = 20,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="First iterations left out of the fit (caches filling).")] = 5,
    threshold_kb_per_iter: Annotated[float, typer.Option("--threshold-kb-per-iter", help="Growth per iteration that counts as a leak.")] = 32.0,
    capture: Annotated[bool, typer.Option("--capture/--no-capture", help="On growth, track one more iteration with memray.")] = True,
    sites: Annotated[int, typer.Option("--sites", min=1, help="Allocation sites to show on growth.")] = 10,
    batch_size: BatchSize = 4,
    input_len: InputLen = 32,
    output_len: OutputLen = 16,
    engine_args: eo.EngineArgs = eo.FLAGS,
    output_dir: OutputDir = None,
    json_output: JsonOut = False,
    dry_run: DryRun = False,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Run a workload repeatedly in this process and report memory growth per iteration (flat / growing).

    Exit codes: 0 = flat; 1 = growing (or the workload failed); 2 = usage error.
    """
    from llmctl.__about__ import __version__
    from llmctl.errors import UserError
    from llmctl.profiling import leak as lk
    from llmctl.profiling import report
    from llmctl.profiling.artifacts import new_manifest, resolved_command

    if bool(workload) == engine:
        raise UserError("give a workload (module:function or file.py:function) or --engine (one of them)")
    plan = lk.LeakPlan(iterations, warmup, threshold_kb_per_iter, capture, sites)
    plan.validate()
    command = resolved_command(ctx)
    if dry_run:
        report.print_dry_run(command, None, json_output)
        return
    if engine:
        job = lk.engine_workload(engine_args, batch_size, input_len, output_len, engine_args.seed)
    else:
        job = lk.load_callable(workload)
    manifest = new_manifest("leak", "llmctl-leak", __version__, output_dir, command=command)
    result = lk.run_leak(job, plan, manifest)
    if not json_output:
        report.print_leak(result)
    report.finish(manifest, json_output, quiet=True)
    if result["verdict"] == "growing":
        raise typer.Exit(1)


@profile_app.command("nsys", cls=help_format.Command)
def nsys(
    workload: Workload = None,
    steps: Annotated[str, typer.Option("--steps", envvar="LLMCTL_PROFILE_NSYS_STEPS", help="Engine steps START:STOP to record (the workload's llmctl engine brackets them with cudaProfilerStart/Stop).")] = "10:20",
    whole_run: Annotated[bool, typer.Option("--whole-run", help="Record the whole run instead (any CUDA program, start-up included).")] = False,
    trace: Annotated[str, typer.Option("--trace", envvar="LLMCTL_PROFILE_NSYS_TRACE", help="APIs nsys traces (its --trace).")] = "cuda,nvtx,osrt,cublas",
    sample_cpu: Annotated[bool, typer.Option("--sample-cpu/--no-sample-cpu", help="Also sample CPU stacks of the process tree.")] = False,
    output_dir: OutputDir = None,
    json_output: JsonOut = False,
    dry_run: DryRun = False,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Record an Nsight Systems timeline of a workload's warm engine steps (llmctl profile nsys -- llmctl serve ...)."""
    import shutil

    from llmctl.profiling import nsys as ns
    from llmctl.profiling import preflight, report
    from llmctl.profiling.artifacts import new_manifest

    plan = ns.NsysPlan(shutil.which("nsys") or "nsys", workload or [], None if whole_run else steps, trace, sample_cpu)
    plan.validate()
    if dry_run:
        report.print_dry_run(ns.record_argv(plan, output_dir or Path("<output-dir>")), None, json_output)
        return
    plan.nsys = ns.require_nsys()
    preflight.require_command(plan.workload)
    manifest = new_manifest("nsys", "nsys", preflight.tool_version(plan.nsys, timeout_s=30.0), output_dir)
    ns.run_record(plan, manifest)
    report.finish(manifest, json_output)


LOAD_PANEL = "Load"


@profile_app.command("server", cls=help_format.Command)
def server(
    ctx: typer.Context,
    base_url: Annotated[Optional[str], typer.Option("--base-url", help="The server, e.g. http://127.0.0.1:8000 (default when neither this nor --port is given).")] = None,
    port: Annotated[Optional[int], typer.Option("--port", envvar=PORT_ENV, help="Shorthand for --base-url http://127.0.0.1:PORT.")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help=API_KEY_HELP)] = None,
    endpoint: Annotated[Endpoint, typer.Option("--endpoint", rich_help_panel=LOAD_PANEL, help=ENDPOINT_HELP)] = Endpoint.completions,
    num_prompts: Annotated[int, typer.Option("--num-prompts", min=1, rich_help_panel=LOAD_PANEL, help="Requests sent while recording.")] = 16,
    request_rate: Annotated[float, typer.Option("--request-rate", rich_help_panel=LOAD_PANEL, help="Requests per second (Poisson arrivals); inf sends all at once.")] = float("inf"),
    max_concurrency: Annotated[Optional[int], typer.Option("--max-concurrency", min=1, rich_help_panel=LOAD_PANEL, help="Most requests in flight at once (default: no limit).")] = None,
    random_input_len: Annotated[int, typer.Option("--random-input-len", min=1, rich_help_panel=LOAD_PANEL, help="Prompt length (random words).")] = 64,
    random_output_len: Annotated[int, typer.Option("--random-output-len", min=1, rich_help_panel=LOAD_PANEL, help="Output tokens per request (max_tokens, ignore_eos).")] = 32,
    seed: Annotated[int, typer.Option("--seed", envvar="LLMCTL_PROFILE_SERVER_SEED", rich_help_panel=LOAD_PANEL, help="Seed of the prompts and arrival times.")] = 0,
    row_limit: Annotated[int, typer.Option("--row-limit", min=1, rich_help_panel=OUT, help="Rows of the top-ops summary of each trace.")] = 15,
    output_dir: OutputDir = None,
    json_output: JsonOut = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", rich_help_panel=OUT, help="Print the HTTP calls and the load, send nothing.")] = False,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Profile a running 'llmctl serve --profile-dir DIR': start torch.profiler, send a short load, stop, fetch the trace.

    Exit codes: 0 ok; 1 every load request failed or the server wrote no trace; 2 usage error or
    unreachable server; 3 profiling not enabled on the server, API key refused, or already recording.
    """
    from llmctl.bench import client
    from llmctl.bench.arrivals import validate_rate
    from llmctl.profiling import report
    from llmctl.profiling import server_profile as sp
    from llmctl.profiling.artifacts import redacted, resolved_command

    try:
        validate_rate(request_rate, 1.0)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--request-rate")
    url = sp.resolve_base_url(*_url_or_port(ctx, base_url, port))
    plan = sp.ServerProfilePlan(url, client.api_key(api_key), endpoint.value,
                                num_prompts, request_rate, max_concurrency, random_input_len, random_output_len,
                                seed, row_limit)
    if dry_run:
        report.print_server_dry_run(sp.dry_run_plan(plan), json_output)
        return
    command = redacted(resolved_command(ctx), "--api-key")
    manifest = sp.run_server_profile(plan, output_dir, command)
    if not json_output:
        report.print_server(manifest)
    report.finish(manifest, json_output, quiet=True)


def _url_or_port(ctx: typer.Context, base_url: Optional[str], port: Optional[int]) -> tuple[Optional[str], Optional[int]]:
    """Both given: the one from the higher-precedence source wins (flag > env > config); a tie is an error."""
    from llmctl.errors import UserError

    if base_url is None or port is None:
        return base_url, port
    url_source, port_source = ctx.get_parameter_source("base_url"), ctx.get_parameter_source("port")
    if url_source == port_source:
        raise UserError("give --base-url or --port, not both")
    return (base_url, None) if url_source.value < port_source.value else (None, port)


