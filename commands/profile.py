"""`llmctl profile`: cpu (py-spy), mem (memray), torch (torch.profiler), server (a live `llmctl serve`'s
torch.profiler under a short load) and leak (RSS growth + memray).

Thin: parse and cross-check flags, run preflight, call `llmctl.profiling`, render the manifest.
Every run writes its files and a manifest.json into one folder; `--json` prints only the manifest.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmctl import help as help_format
from llmctl import engine_options as eo
from llmctl.config import ConfigOption

profile_app = typer.Typer(
    cls=help_format.Group,
    name="profile",
    help="Profile a workload or a running process: CPU (py-spy), memory (memray), torch ops, a live server, leaks.",
    no_args_is_help=True,
)

OUT = "Output"
# Not LLMCTL_PORT: that is the port `serve` listens on, and set for it, it would also make every
# `profile cpu -- CMD` refuse "a workload and --port" (issue 11).
PORT_ENV = "LLMCTL_PROFILE_PORT"
WORKLOAD_PANEL = "Workload"


class CpuFormat(str, enum.Enum):
    flamegraph = "flamegraph"
    speedscope = "speedscope"
    chrometrace = "chrometrace"
    raw = "raw"


class MemReport(str, enum.Enum):
    flamegraph = "flamegraph"
    table = "table"
    summary = "summary"
    stats = "stats"


class SortKey(str, enum.Enum):
    self_cpu_time_total = "self_cpu_time_total"
    cpu_time_total = "cpu_time_total"
    self_device_time_total = "self_device_time_total"
    device_time_total = "device_time_total"
    count = "count"
    self_cpu_memory_usage = "self_cpu_memory_usage"
    cpu_memory_usage = "cpu_memory_usage"


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


def _attach_target(pid: Optional[int], port: Optional[int], workload: Optional[list[str]], *, allow_workload: bool = True) -> Optional[int]:
    """Exactly one of --pid, --port or a workload; returns the PID to attach to (None: a workload)."""
    from llmctl.errors import UserError
    from llmctl.profiling import preflight

    given = [name for name, value in (("--pid", pid), ("--port", port), ("a workload", workload)) if value]
    if len(given) != 1:
        what = "--pid, --port or a workload after --" if allow_workload else "--pid or --port"
        raise UserError(f"give one of {what} (got {', '.join(given) or 'none'})")
    if workload and not allow_workload:
        raise UserError("this mode attaches to a running process: give --pid or --port")
    if workload:
        return None
    target = preflight.pid_for_port(port) if port is not None else pid
    preflight.require_attach(target)
    return target


def _check_command(workload: list[str]) -> None:
    import os
    import shutil

    from llmctl.errors import UserError

    if not (shutil.which(workload[0]) or (os.sep in workload[0] and os.path.exists(workload[0]))):
        raise UserError(f"workload command not found: {workload[0]}")


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
    from llmctl.profiling import preflight, pyspy

    if top and dump:
        raise UserError("--top and --dump are different modes; pick one")
    if top and json_output:
        raise UserError("--top is a live view; it has no JSON output")
    pyspy_path = preflight.require_pyspy()
    target = _attach_target(pid, port, workload, allow_workload=not dump)
    if workload:
        _check_command(workload)
    plan = pyspy.CpuPlan(pyspy_path, pyspy.Sampling(rate, native, subprocesses, idle, gil), pid=target,
                         workload=workload, duration=duration, fmt=format.value, json_mode=json_output)
    if top:
        _cpu_top(plan, dry_run)
        return
    if dry_run:
        folder = output_dir or Path("<output-dir>")
        command = (pyspy.dump_argv(plan, plan.target_pid_text()) if dump else
                   pyspy.record_argv(plan, plan.target_pid_text(), str(folder / pyspy.OUTPUT_NAMES[plan.fmt])))
        _print_dry_run(command, workload, json_output)
        return
    manifest = _manifest("cpu", "py-spy", preflight.pyspy_version(pyspy_path), output_dir)
    if dump:
        text = pyspy.run_dump(plan, manifest)
        if not json_output and manifest.status == "ok":
            typer.echo(text, nl=False)
        _finish(manifest, json_output, quiet=True)
        return
    pyspy.run_record(plan, manifest)
    _finish(manifest, json_output)


def _cpu_top(plan: Any, dry_run: bool) -> None:
    from llmctl.profiling import procs, pyspy

    if dry_run:
        _print_dry_run(pyspy.top_argv(plan, plan.target_pid_text()), plan.workload, False)
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

    reports = [r.value for r in (report or [MemReport.flamegraph])]
    if leaks and not set(reports) & set(mt.LEAK_REPORTS):
        raise UserError("--leaks applies to the flamegraph and table reports")
    version = preflight.require_memray()
    target = _attach_target(pid, port, workload)
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
        _print_dry_run(commands[0], None, json_output, then=commands[1:])
        return
    manifest = _manifest("mem", "memray", version, output_dir)
    mt.run_capture(plan, manifest)
    if not json_output:
        _print_mem(manifest)
    _finish(manifest, json_output)


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
    engine_args: eo.EngineArgs = eo.FLAGS,
    output_dir: OutputDir = None,
    json_output: JsonOut = False,
    dry_run: DryRun = False,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Run engine steps under torch.profiler: Chrome/Perfetto trace (.json.gz) and the operator table."""
    from llmctl.profiling import torch_trace as tt

    sched, shrunk = tt.fit_schedule(steps, wait, warmup, active)
    plan = tt.TorchPlan(engine_args, batch_size, input_len, output_len, sched["wait"], sched["warmup"], sched["active"],
                        steps, sort_by.value, row_limit, record_shapes, engine_args.seed)
    plan.validate()
    if shrunk:
        typer.echo(f"llmctl: note: --steps {steps} is shorter than the default schedule; profiling "
                   f"wait {plan.wait} + warmup {plan.warmup} + active {plan.active}", err=True)
    command = _reproduce(ctx)
    if dry_run:
        _print_dry_run(command, None, json_output)
        return
    import torch

    manifest = _manifest("torch", "torch.profiler", torch.__version__, output_dir, command=command)
    table = tt.run_torch(plan, manifest)
    if not json_output:
        typer.echo(table)
        typer.echo(f"trace: {manifest.output_dir / tt.TRACE_NAME} (open in https://ui.perfetto.dev)")
    _finish(manifest, json_output, quiet=True)


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

    if bool(workload) == engine:
        raise UserError("give a workload (module:function or file.py:function) or --engine (one of them)")
    plan = lk.LeakPlan(iterations, warmup, threshold_kb_per_iter, capture, sites)
    plan.validate()
    command = _reproduce(ctx)
    if dry_run:
        _print_dry_run(command, None, json_output)
        return
    if engine:
        job = lk.engine_workload(engine_args, batch_size, input_len, output_len, engine_args.seed)
    else:
        job = lk.load_callable(workload)
    manifest = _manifest("leak", "llmctl-leak", __version__, output_dir, command=command)
    result = lk.run_leak(job, plan, manifest)
    if not json_output:
        _print_leak(result)
    _finish(manifest, json_output, quiet=True)
    if result["verdict"] == "growing":
        raise typer.Exit(1)


class ServerEndpoint(str, enum.Enum):
    completions = "completions"
    chat = "chat"


LOAD_PANEL = "Load"


@profile_app.command("server", cls=help_format.Command)
def server(
    ctx: typer.Context,
    base_url: Annotated[Optional[str], typer.Option("--base-url", help="The server, e.g. http://127.0.0.1:8000 (default when neither this nor --port is given).")] = None,
    port: Annotated[Optional[int], typer.Option("--port", envvar=PORT_ENV, help="Shorthand for --base-url http://127.0.0.1:PORT.")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Bearer token (default: $OPENAI_API_KEY).")] = None,
    endpoint: Annotated[ServerEndpoint, typer.Option("--endpoint", rich_help_panel=LOAD_PANEL, help="/v1/completions or /v1/chat/completions.")] = ServerEndpoint.completions,
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
    import os

    from llmctl.bench.arrivals import validate_rate
    from llmctl.profiling import server_profile as sp

    try:
        validate_rate(request_rate, 1.0)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--request-rate")
    url = sp.resolve_base_url(*_url_or_port(ctx, base_url, port))
    plan = sp.ServerProfilePlan(url, api_key or os.environ.get("OPENAI_API_KEY") or None, endpoint.value,
                                num_prompts, request_rate, max_concurrency, random_input_len, random_output_len,
                                seed, row_limit)
    if dry_run:
        _print_server_dry_run(sp.dry_run_plan(plan), json_output)
        return
    command = _redact(_reproduce(ctx), "--api-key")
    manifest = sp.run_server_profile(plan, output_dir, command)
    if not json_output:
        _print_server(manifest)
    _finish(manifest, json_output, quiet=True)


def _url_or_port(ctx: typer.Context, base_url: Optional[str], port: Optional[int]) -> tuple[Optional[str], Optional[int]]:
    """Both given: the one from the higher-precedence source wins (flag > env > config); a tie is an error."""
    from llmctl.errors import UserError

    if base_url is None or port is None:
        return base_url, port
    url_source, port_source = ctx.get_parameter_source("base_url"), ctx.get_parameter_source("port")
    if url_source == port_source:
        raise UserError("give --base-url or --port, not both")
    return (base_url, None) if url_source.value < port_source.value else (None, port)


def _redact(argv: list[str], flag: str) -> list[str]:
    return [("***" if i and argv[i - 1] == flag else arg) for i, arg in enumerate(argv)]


def _print_server_dry_run(plan: dict, json_output: bool) -> None:
    from llmctl.output import print_json
    from llmctl.profiling.procs import shell_join

    if json_output:
        print_json(plan)
        return
    auth = f"    (Authorization: {plan['authorization']})" if plan["authorization"] else ""
    for call in plan["http_calls"]:
        protected = any(path in call for path in ("/start_profile", "/stop_profile", "/v1/"))
        typer.echo(call + (auth if protected else ""))
    typer.echo(f"load: {shell_join(plan['load_command'])}")
    typer.echo("POST /stop_profile runs even when the load fails or is interrupted.")


def _print_server(manifest: Any) -> None:
    result = manifest.result
    load = result.get("load")
    if load:
        ttft = (f"; TTFT p50 {load['ttft_ms']['p50']:.1f} ms, p99 {load['ttft_ms']['p99']:.1f} ms"
                if load["completed"] else "")
        typer.echo(f"{load['model']} @ {result['server']}: {load['completed']} completed, {load['failed']} failed "
                   f"in {load['duration_s']:.2f} s ({load['request_throughput']:.2f} req/s, "
                   f"{load['output_throughput']:.1f} output tok/s){ttft}")
        for sample in load["error_samples"]:
            status = "no response" if sample["status"] is None else f"HTTP {sample['status']}"
            typer.echo(f"llmctl: {sample['count']} request(s) failed: {status}: {sample['message']}", err=True)
    for trace in result.get("traces", []):
        typer.echo(f"trace on the server: {trace['server_path']}")
        if trace["local_copy"] is None:
            typer.echo(f"  {trace['note']}")
            continue
        typer.echo(f"  copied to {manifest.output_dir / trace['local_copy']} (open in https://ui.perfetto.dev)")
        summary = trace["summary"]
        if summary is None:
            typer.echo(f"  {trace['note']}")
            continue
        span = f" over {summary['span_ms']:.1f} ms" if summary["span_ms"] is not None else ""
        typer.echo(f"  {summary['events']} events{span}")
        for key, title in (("top_ops", "CPU ops"), ("top_kernels", "CUDA kernels")):
            if summary.get(key):
                typer.echo(f"  {title} by total time (inclusive):\n  {'total ms':>10} {'calls':>7}  name")
                for row in summary[key]:
                    typer.echo(f"  {row['total_ms']:>10.3f} {row['calls']:>7}  {row['name']}")
    if result.get("note"):
        typer.echo(result["note"])


# ---- shared helpers ----------------------------------------------------------------------------
def _manifest(kind: str, tool: str, version: Optional[str], output_dir: Optional[Path], command: Optional[list[str]] = None):
    from llmctl.profiling.artifacts import Manifest, prepare_output_dir

    return Manifest(kind=kind, tool=tool, tool_version=version, command=command or [],
                    output_dir=prepare_output_dir(output_dir, kind))


def _finish(manifest: Any, json_output: bool, quiet: bool = False) -> None:
    """Print the manifest (--json) or where the files are; a failed run exits non-zero with its message."""
    from llmctl.errors import UserError
    from llmctl.output import print_json

    if json_output:
        print_json(manifest.to_dict())
    elif not quiet and manifest.status in ("ok", "workload_failed"):
        for name in manifest.files:
            typer.echo(f"wrote {manifest.output_dir / name}")
    if manifest.status not in ("ok",):
        raise UserError(manifest.message or manifest.status, exit_code=1)
    if not json_output:
        typer.echo(f"manifest: {manifest.output_dir / 'manifest.json'}", err=quiet)


def _print_dry_run(command: list[str], workload: Optional[list[str]], json_output: bool,
                   then: Optional[list[list[str]]] = None) -> None:
    from llmctl.output import print_json
    from llmctl.profiling.procs import shell_join

    if json_output:
        print_json({"dry_run": True, "command": command, "workload_command": workload, "then": then or []})
        return
    if workload:
        typer.echo(f"{shell_join(workload)}    # started by llmctl; py-spy attaches to its PID")
    typer.echo(shell_join(command))
    for extra in then or []:
        typer.echo(shell_join(extra))


def _reproduce(ctx: typer.Context) -> list[str]:
    """The fully resolved llmctl command line of an in-process profile (flags from env/config spelled out)."""
    argv = ctx.command_path.split()
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if param.name in ("config", "dry_run", "json_output") or value is None or value == []:
            continue
        if param.param_type_name == "argument":
            argv.append(str(value))
        elif param.is_flag:
            if param.secondary_opts:
                argv.append(param.opts[0] if value else param.secondary_opts[0])
            elif value:
                argv.append(param.opts[0])
        else:
            argv += [param.opts[0], str(value.value if isinstance(value, enum.Enum) else value)]
    return argv


def _print_mem(manifest: Any) -> None:
    import json

    peak = manifest.result.get("peak_memory_bytes")
    if peak is not None:
        typer.echo(f"peak memory: {_size(peak)}")
    for name, info in manifest.result.get("reports", {}).items():
        if info.get("error"):
            typer.echo(f"{name} report failed: {info['error'].splitlines()[-1]}", err=True)
        elif name == "summary":
            typer.echo((manifest.output_dir / info["file"]).read_text(), nl=False)
        elif name == "stats":
            stats = json.loads((manifest.output_dir / info["file"]).read_text())
            typer.echo(f"{stats['total_num_allocations']} allocations, {_size(stats['total_bytes_allocated'])} in total; largest:")
            for row in stats["top_allocations_by_size"][:5]:
                typer.echo(f"  {_size(row['size']):>10}  {row['location']}")


def _print_leak(result: dict) -> None:
    rss = result["rss"]
    typer.echo(f"RSS {_size(rss['start_kb'] * 1024)} -> {_size(rss['end_kb'] * 1024)} over "
               f"{result['iterations'] - result['warmup']} iterations after {result['warmup']} warm-up: "
               f"{rss['slope_kb_per_iter']:+.1f} KB/iteration (t {rss['t'] if rss['t'] is not None else 'inf'}, R^2 {rss['r2']:.2f})")
    if "cuda_allocated" in result:
        cuda = result["cuda_allocated"]
        typer.echo(f"CUDA allocated {_size(cuda['start_kb'] * 1024)} -> {_size(cuda['end_kb'] * 1024)}: "
                   f"{cuda['slope_kb_per_iter']:+.1f} KB/iteration")
    typer.echo(f"verdict: {result['verdict'].upper()} (threshold {result['threshold_kb_per_iter']:g} KB/iteration)")
    if result.get("capture_skipped"):
        typer.echo(f"no allocation sites: {result['capture_skipped']}")
    if result.get("suspects"):
        typer.echo("allocations still alive after one more iteration (largest first):")
        for site in result["suspects"]:
            typer.echo(f"  {_size(site['size_bytes']):>10} in {site['allocations']} allocation(s)  {site['stack'][0]}")
            for frame in site["stack"][1:3]:
                typer.echo(f"  {'':>10}   <- {frame}")


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"
