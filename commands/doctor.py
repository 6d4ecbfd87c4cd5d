"""`llmctl doctor`: run the 28-item preflight checklist and report it as a table or JSON."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import typer

from llmctl import engine_options as eo
from llmctl.config import ConfigOption
from llmctl.engine.args import DEFAULT_MASTER_PORT

_STYLES = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim", "info": "cyan"}


def _thresholds(value: Any) -> Any:
    from llmctl.checks.settings import parse_thresholds

    try:
        return parse_thresholds(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--thresholds")


def _complete_check_ids(incomplete: str) -> list[str]:
    """Check ids for shell completion (the static scripts in completions/ list them all)."""
    from llmctl.checks.registry import CHECKS

    return [check.id for check in CHECKS if check.id.startswith(incomplete)]


def doctor(
    config: Optional[Path] = ConfigOption,
    only: Optional[str] = typer.Option(None, "--only", metavar="ID,...", autocompletion=_complete_check_ids, help="Run only these checks (comma-separated ids)."),
    skip: Optional[str] = typer.Option(None, "--skip", metavar="ID,...", autocompletion=_complete_check_ids, help="Leave these checks out (comma-separated ids)."),
    list_checks: bool = typer.Option(False, "--list", help="List the check ids with one-line descriptions and exit."),
    explain: Optional[str] = typer.Option(None, "--explain", metavar="ID", autocompletion=_complete_check_ids, help="Explain one check, its thresholds and exit."),
    json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout (nothing else)."),
    strict: bool = typer.Option(False, "--strict", help="Warnings fail too (exit 1)."),
    expect_gpus: Optional[int] = typer.Option(None, "--expect-gpus", min=1, help="This host must have at least N GPUs; no GPUs then fails."),
    model: Optional[Path] = typer.Option(None, "--model", help="Model directory or file, for the disk-space-model check."),
    gpu_memory_utilization: float = typer.Option(
        0.9, "--gpu-memory-utilization", min=0.01, max=1.0, help="Planned fraction of each GPU's memory (gpu-memory-free)."
    ),
    thresholds: Optional[str] = typer.Option(
        None, "--thresholds", metavar="KEY=VALUE,...", parser=_thresholds,
        help="Override thresholds (YAML: a 'thresholds:' mapping); defaults in docs/doctor.md.",
    ),
    server: Optional[str] = typer.Option(None, "--server", metavar="URL", help="Also check a running llmctl serve (server-ready): health, alerted metrics, /v1 auth."),
    tensor_parallel_size: eo.engine_flag("tensor_parallel_size", min=1) = 1,
    master_addr: eo.engine_flag("master_addr") = "127.0.0.1",
    master_port: eo.engine_flag("master_port", min=0, max=65535) = None,
    bundle: Optional[Path] = typer.Option(None, "--bundle", metavar="DIR", file_okay=False, help="Also write a support bundle there: the JSON report, nvidia-smi -q and topology, pip freeze, the NVIDIA kernel-log lines, the environment with secrets masked."),
) -> None:
    """Check this host against the 28-item LLM inference preflight checklist (reads only, changes nothing).

    Exit codes: 0 = every check passed (warnings allowed); 1 = a check failed, or warned with --strict; 2 = usage error.

    In CI: llmctl doctor --json > report.json || exit 1
    """
    from llmctl.checks.registry import BY_ID, CHECKS, DEPLOYMENT_CHECKS, parse_ids, select
    from llmctl.checks.settings import Plan, Thresholds
    from llmctl.errors import UserError

    if list_checks:
        _print_list(CHECKS + DEPLOYMENT_CHECKS, json)
        return
    if explain is not None:
        if explain not in BY_ID:
            raise UserError(f"--explain: unknown check id {explain!r} (see 'llmctl doctor --list')")
        _print_explain(BY_ID[explain], thresholds or Thresholds(), json)
        return
    if server is not None and not server.startswith(("http://", "https://")):
        raise UserError(f"--server {server}: give the server's URL, e.g. http://10.0.0.5:8000")
    checks = select(parse_ids(only, "--only"), parse_ids(skip, "--skip"), server=server is not None)
    plan = Plan(expect_gpus, model, gpu_memory_utilization, thresholds or Thresholds(), server,
                tensor_parallel_size=tensor_parallel_size, master_addr=master_addr,
                master_port=DEFAULT_MASTER_PORT if master_port is None else master_port)
    report = _run(checks, plan, strict, with_facts=json or bundle is not None, bundle=bundle)
    _render(report, json)
    raise typer.Exit(report["summary"]["exit_code"])


def _run(checks: list, plan: Any, strict: bool, with_facts: bool, bundle: Optional[Path] = None) -> dict:
    from llmctl.checks.probe import open_nvml
    from llmctl.checks.runner import live_host, report, run_checks

    started = time.monotonic()
    with open_nvml() as (nvml, reason, mismatch):
        host = live_host(nvml, reason, mismatch, plan)
        results = run_checks(checks, host, plan)
        document = report(results, checks, host, plan, strict, started, with_facts)
        if bundle is not None:
            _write_bundle(bundle, document, host)
        return document


def _write_bundle(folder: Path, document: dict, host: Any) -> None:
    import sys

    from llmctl.checks.bundle import write_bundle

    missing = {name: why for name, why in write_bundle(folder, document, host).items() if why != "ok"}
    left_out = "".join(f"; {name} left out: {why}" for name, why in missing.items())
    sys.stderr.write(f"llmctl: support bundle written to {folder}{left_out}\n")


def _render(report: dict, as_json: bool) -> None:
    from llmctl.output import print_json, stdout_console

    if as_json:
        print_json(report)
        return
    console = stdout_console()
    if console.is_terminal:
        _rich_table(console, report)
    else:
        _plain(report)
    typer.echo(_summary_line(report["summary"]))


def _summary_line(summary: dict) -> str:
    parts = ", ".join(f"{summary[s]} {s}" for s in ("fail", "warn", "pass", "info", "skip") if summary[s])
    return f"{summary['total']} checks: {parts or 'none run'} ({summary['duration_s']:.1f} s) -> exit {summary['exit_code']}"


def _rich_table(console: Any, report: dict) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(show_lines=False, expand=False)
    for name in ("", "check", "result", "fix"):
        table.add_column(name, overflow="fold")
    area = None
    for row in report["results"]:
        if row["area"] != area:
            area = row["area"]
            if table.row_count:
                table.add_section()
            table.add_row("", Text(area, style="bold"), "", "")
        status = row["status"]
        table.add_row(Text(status.upper(), style=_STYLES[status]), Text(row["id"]), _result_text(row), Text(row["fix"] or ""))
    console.print(table)


def _result_text(row: dict) -> Any:
    from rich.text import Text

    text = Text(row["summary"])
    if row["status"] in ("fail", "warn") and row["details"]:
        text.append("\n" + "\n".join(row["details"]), style="dim")
    return text


def _plain(report: dict) -> None:
    area = None
    width = max((len(row["id"]) for row in report["results"]), default=0)
    for row in report["results"]:
        if row["area"] != area:
            area = row["area"]
            typer.echo(area)
        typer.echo(f"  {row['status'].upper():<4}  {row['id']:<{width}}  {row['summary']}")
        if row["status"] in ("fail", "warn"):
            for detail in row["details"]:
                typer.echo(f"  {'':<4}  {'':<{width}}    {detail}")
        if row["fix"] and row["status"] in ("fail", "warn"):
            typer.echo(f"  {'':<4}  {'':<{width}}  fix: {row['fix']}")


def _print_list(checks: tuple, as_json: bool) -> None:
    from llmctl.output import print_json

    if as_json:
        print_json([{"id": c.id, "area": c.area, "title": c.title} for c in checks])
        return
    width = max(len(c.id) for c in checks)
    for check in checks:
        typer.echo(f"{check.id:<{width}}  {check.area:<17}  {check.title}")


def _print_explain(check: Any, thresholds: Any, as_json: bool) -> None:
    from llmctl.output import print_json

    used = {name: value for name, value in thresholds.to_dict().items() if name in check.explain}
    if as_json:
        print_json({"id": check.id, "area": check.area, "title": check.title, "explain": check.explain, "thresholds": used})
        return
    typer.echo(f"{check.id} ({check.area}): {check.title}\n")
    typer.echo(check.explain)
    if used:
        typer.echo("\nthresholds: " + ", ".join(f"{name}={value}" for name, value in used.items()))
