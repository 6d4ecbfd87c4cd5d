"""Terminal rendering for `llmctl profile`: dry-run command lines, the manifest or the files a run
wrote, and each kind's short summary (mem, leak, server). `--json` prints only the manifest."""

from __future__ import annotations

from typing import Any, Optional

import typer

from llmctl.errors import UserError
from llmctl.output import format_bytes, print_json
from llmctl.profiling.procs import shell_join


def finish(manifest: Any, json_output: bool, quiet: bool = False) -> None:
    """Print the manifest (--json) or where the files are; a failed run exits non-zero with its message."""
    if json_output:
        print_json(manifest.to_dict())
    elif not quiet and manifest.status in ("ok", "workload_failed"):
        for name in manifest.files:
            typer.echo(f"wrote {manifest.output_dir / name}")
    if manifest.status not in ("ok",):
        raise UserError(manifest.message or manifest.status, exit_code=1)
    if not json_output:
        typer.echo(f"manifest: {manifest.output_dir / 'manifest.json'}", err=quiet)


def print_dry_run(command: list[str], workload: Optional[list[str]], json_output: bool,
                  then: Optional[list[list[str]]] = None) -> None:
    if json_output:
        print_json({"dry_run": True, "command": command, "workload_command": workload, "then": then or []})
        return
    if workload:
        typer.echo(f"{shell_join(workload)}    # started by llmctl; py-spy attaches to its PID")
    typer.echo(shell_join(command))
    for extra in then or []:
        typer.echo(shell_join(extra))


def print_server_dry_run(plan: dict, json_output: bool) -> None:
    if json_output:
        print_json(plan)
        return
    auth = f"    (Authorization: {plan['authorization']})" if plan["authorization"] else ""
    for call in plan["http_calls"]:
        protected = any(path in call for path in ("/start_profile", "/stop_profile", "/v1/"))
        typer.echo(call + (auth if protected else ""))
    typer.echo(f"load: {shell_join(plan['load_command'])}")
    typer.echo("POST /stop_profile runs even when the load fails or is interrupted.")


def print_server(manifest: Any) -> None:
    from llmctl.bench.report import print_load_errors

    result = manifest.result
    load = result.get("load")
    if load:
        ttft = (f"; TTFT p50 {load['ttft_ms']['p50']:.1f} ms, p99 {load['ttft_ms']['p99']:.1f} ms"
                if load["completed"] else "")
        typer.echo(f"{load['model']} @ {result['server']}: {load['completed']} completed, {load['failed']} failed "
                   f"in {load['duration_s']:.2f} s ({load['request_throughput']:.2f} req/s, "
                   f"{load['output_throughput']:.1f} output tok/s){ttft}")
        print_load_errors(load["error_samples"])
    for trace in result.get("traces", []):
        _print_trace(manifest, trace)
    if result.get("note"):
        typer.echo(result["note"])


def _print_trace(manifest: Any, trace: dict[str, Any]) -> None:
    typer.echo(f"trace on the server: {trace['server_path']}")
    if trace["local_copy"] is None:
        typer.echo(f"  {trace['note']}")
        return
    typer.echo(f"  copied to {manifest.output_dir / trace['local_copy']} (open in https://ui.perfetto.dev)")
    summary = trace["summary"]
    if summary is None:
        typer.echo(f"  {trace['note']}")
        return
    span = f" over {summary['span_ms']:.1f} ms" if summary["span_ms"] is not None else ""
    typer.echo(f"  {summary['events']} events{span}")
    for key, title in (("top_ops", "CPU ops"), ("top_kernels", "CUDA kernels")):
        if summary.get(key):
            typer.echo(f"  {title} by total time (inclusive):\n  {'total ms':>10} {'calls':>7}  name")
            for row in summary[key]:
                typer.echo(f"  {row['total_ms']:>10.3f} {row['calls']:>7}  {row['name']}")


def print_mem(manifest: Any) -> None:
    import json

    peak = manifest.result.get("peak_memory_bytes")
    if peak is not None:
        typer.echo(f"peak memory: {format_bytes(peak)}")
    for name, info in manifest.result.get("reports", {}).items():
        if info.get("error"):
            typer.echo(f"{name} report failed: {info['error'].splitlines()[-1]}", err=True)
        elif name == "summary":
            typer.echo((manifest.output_dir / info["file"]).read_text(), nl=False)
        elif name == "stats":
            stats = json.loads((manifest.output_dir / info["file"]).read_text())
            typer.echo(f"{stats['total_num_allocations']} allocations, "
                       f"{format_bytes(stats['total_bytes_allocated'])} in total; largest:")
            for row in stats["top_allocations_by_size"][:5]:
                typer.echo(f"  {format_bytes(row['size']):>10}  {row['location']}")


def print_leak(result: dict) -> None:
    rss = result["rss"]
    typer.echo(f"RSS {format_bytes(rss['start_kb'] * 1024)} -> {format_bytes(rss['end_kb'] * 1024)} over "
               f"{result['iterations'] - result['warmup']} iterations after {result['warmup']} warm-up: "
               f"{rss['slope_kb_per_iter']:+.1f} KB/iteration (t {rss['t'] if rss['t'] is not None else 'inf'}, "
               f"R^2 {rss['r2']:.2f})")
    if "cuda_allocated" in result:
        cuda = result["cuda_allocated"]
        typer.echo(f"CUDA allocated {format_bytes(cuda['start_kb'] * 1024)} -> {format_bytes(cuda['end_kb'] * 1024)}: "
                   f"{cuda['slope_kb_per_iter']:+.1f} KB/iteration")
    typer.echo(f"verdict: {result['verdict'].upper()} (threshold {result['threshold_kb_per_iter']:g} KB/iteration)")
    if result.get("capture_skipped"):
        typer.echo(f"no allocation sites: {result['capture_skipped']}")
    if result.get("suspects"):
        typer.echo("allocations still alive after one more iteration (largest first):")
        for site in result["suspects"]:
            typer.echo(f"  {format_bytes(site['size_bytes']):>10} in {site['allocations']} allocation(s)  "
                       f"{site['stack'][0]}")
            for frame in site["stack"][1:3]:
                typer.echo(f"  {'':>10}   <- {frame}")
