"""Terminal rendering for `llmctl bench` (hardware, throughput, latency, serve): a Rich table and
live progress on a TTY, plain aligned text when piped. JSON output is printed by the runners."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Optional

from llmctl.output import format_bytes, is_interactive, stderr_console, stdout_console

DASH = "—"


@contextlib.contextmanager
def progress_bar(enabled: bool) -> Iterator[Any]:
    """Yields `update(label, done, total)`: a transient Rich bar on stderr when `enabled` and stderr
    is a terminal, a no-op otherwise (piped runs stay quiet)."""
    console = stderr_console()
    if not enabled or not is_interactive(console):
        yield lambda label, done, total: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def update(label: str, done: int, total: int) -> None:
            bar.update(task, description=label, completed=done, total=total)

        yield update


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    console = stderr_console()
    if is_interactive(console):
        with console.status(message):
            yield
    else:
        yield


def fmt(value: Optional[float]) -> str:
    if value is None:
        return DASH
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.1f}"


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> None:
    out = stdout_console()
    if out.is_terminal:
        from rich.table import Table

        table = Table()
        for i, name in enumerate(headers):
            table.add_column(name, justify="right" if i in right else "left")
        for row in rows:
            table.add_row(*row)
        out.print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out.file.write("  ".join(cells).rstrip() + "\n")
    out.file.flush()


def render_inventory(devices: list[dict[str, Any]]) -> None:
    out = stdout_console()
    for d in devices:
        if d["kind"] == "cpu":
            out.print(f"{d['label']}: {d['name']}, {d['logical_cores']} logical cores, torch threads {d['threads']}",
                      markup=False, highlight=False)
        else:
            link = d.get("pcie") or {}
            pcie = (f", PCIe gen{link.get('current_gen')} x{link.get('current_width')} "
                    f"(max gen{link.get('max_gen')} x{link.get('max_width')})") if link else ""
            out.print(f"{d['label']}: {d['name']} ({d['product'] or 'not in the datasheet table'}), "
                      f"{format_bytes(d['memory_bytes'])}, sm_{d['compute_capability'].replace('.', '')}, "
                      f"driver {d.get('driver_version') or '?'}, CUDA {d.get('cuda_version')}{pcie}",
                      markup=False, highlight=False)


# (header, width, right-aligned): fixed widths because rows are printed one by one as figures complete
HARDWARE_COLUMNS = (("device", 14, False), ("benchmark", 36, False), ("median", 10, True), ("min", 10, True),
                    ("max", 10, True), ("spread", 7, True), ("unit", 9, False), ("peak", 9, True),
                    ("% of peak", 9, True))


def hardware_row(r: dict[str, Any]) -> list[str]:
    spread = DASH if r.get("spread_pct") is None else f"{r['spread_pct']:.0f}%"
    return [r["device"], r["label"], fmt(r["median"]), fmt(r["min"]), fmt(r["max"]), spread, r["unit"],
            fmt(r["peak"]), DASH if r["pct_of_peak"] is None else f"{r['pct_of_peak']:.1f}%"]


class HardwareRows:
    """Prints the hardware table one row per figure as it completes (the header before the first), so
    a run cut short (killed, interrupted) still shows what it measured."""

    def __init__(self) -> None:
        self.started = False

    def _line(self, cells: list[str]) -> None:
        text = "  ".join(c.rjust(w) if right else c.ljust(w) for c, (_, w, right) in zip(cells, HARDWARE_COLUMNS))
        sys.stdout.write(text.rstrip() + "\n")
        sys.stdout.flush()

    def __call__(self, result: dict[str, Any]) -> None:
        if not self.started:
            self._line([name for name, _, _ in HARDWARE_COLUMNS])
            self.started = True
        self._line(hardware_row(result))


def measured_line(result: dict[str, Any]) -> None:
    """One figure on stderr as it completes, for --json runs (stdout holds only the document)."""
    sys.stderr.write(f"llmctl: measured {result['device']} {result['label']}: {fmt(result['median'])} "
                     f"{result['unit']} (median of {result['repeats']})\n")
    sys.stderr.flush()


def render_throughput(doc: dict[str, Any]) -> None:
    rows = [_rate_row("llmctl", doc)]
    if doc.get("transformers"):
        rows.append(_rate_row(f"transformers {doc['transformers']['version']}", doc["transformers"]))
    _table(["system", "requests/s", "output tok/s", "total tok/s", "elapsed s"], rows, {1, 2, 3, 4})
    _summary_line(doc)
    if doc.get("cost"):
        from llmctl.bench.cost import cost_rows

        for label, value in cost_rows(doc["cost"]):
            stdout_console().print(label if value is None else f"  {label}: {value}", markup=False, highlight=False)


def _rate_row(name: str, doc: dict[str, Any]) -> list[str]:
    def pm(key: str) -> str:
        stat = doc[key]
        return f"{fmt(stat['mean'])} ± {fmt(stat['std'])}" if doc["repeats"] > 1 else fmt(stat["mean"])

    return [name, pm("requests_per_second"), pm("output_tokens_per_second"), pm("total_tokens_per_second"),
            fmt(sum(doc["elapsed_times"]) / len(doc["elapsed_times"]))]


def render_latency(doc: dict[str, Any]) -> None:
    systems = [("llmctl", doc)] + ([(f"transformers {doc['transformers']['version']}", doc["transformers"])]
                                   if doc.get("transformers") else [])
    headers = ["system", "mean s", "std s", *(f"p{p}" for p in doc["percentiles"])]
    rows = [[name, f"{d['avg_latency']:.4f}", f"{d['std_latency']:.4f}", *(f"{v:.4f}" for v in d["percentiles"].values())]
            for name, d in systems]
    _table(headers, rows, set(range(1, len(headers))))
    _summary_line(doc)


def _summary_line(doc: dict[str, Any]) -> None:
    w = doc["workload"]
    shape = (f"{w['num_prompts']} prompts" if doc["benchmark"] == "throughput" else f"batch {w['batch_size']}")
    weights = f"{doc['quantization']} weights" if doc.get("quantization") else "weights"
    text = (f"{doc['model']} ({doc['load_format']} {weights}, {doc['dtype']}, {doc['device']}, "
            f"tensor parallel {doc['tensor_parallel_size']}): {shape}, "
            f"{w['prompt_tokens']} prompt + {w['output_tokens']} output tokens")
    if doc.get("weight_bytes"):
        text += (f"; weights {format_bytes(doc['weight_bytes'])}, KV cache {format_bytes(doc['kv_cache_bytes'])}")
    ratio = doc.get("ratio_vs_transformers")
    if ratio:
        key, value = next(iter(ratio.items()))
        text += f"; llmctl / transformers = {value:.2f}x ({key.replace('_', ' ')})"
    stdout_console().print(text, markup=False, highlight=False)
    if doc.get("spec_decode"):
        stdout_console().print(_spec_decode_line(doc["spec_decode"]), markup=False, highlight=False)


def _spec_decode_line(spec: dict[str, Any]) -> str:
    if not spec["num_drafts"]:
        return "speculative decoding: no drafts were proposed"
    return (f"speculative decoding: {spec['num_accepted_tokens']} of {spec['num_draft_tokens']} draft tokens "
            f"accepted ({100 * spec['acceptance_rate']:.1f} %), mean acceptance length "
            f"{spec['mean_acceptance_length']:.2f} tokens per verify row ({spec['num_drafts']} rows)")


# ---- bench serve -----------------------------------------------------------------------------------

@contextlib.contextmanager
def load_progress(target: Any, plan: Any, num_requests: Optional[int], num_warmups: int) -> Iterator[Optional[Callable]]:
    """Yields the `observe(phase, outcome)` of a live bar per phase (warm-up, benchmark) with failure
    counts on a TTY, None when stderr is piped."""
    err = stderr_console()
    if not is_interactive(err):
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    failed = {"warmup": 0, "bench": 0}
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("[red]{task.fields[failed]} failed"), TimeElapsedColumn())
    rate = "all at once" if plan.request_rate == float("inf") else f"{plan.request_rate:g} req/s"
    count = f"{num_requests} requests" if num_requests is not None else f"requests for {plan.duration_s:g} s"
    limit = f", at most {plan.max_concurrency} in flight" if plan.max_concurrency else ""
    err.print(f"[bold]{target.model}[/bold] @ {target.url}: {count}, {rate}{limit}", markup=True)
    with Progress(*columns, console=err, transient=True) as progress:
        tasks = {}
        if num_warmups:
            tasks["warmup"] = progress.add_task("warm-up", total=num_warmups, failed=0)
        tasks["bench"] = progress.add_task("benchmark", total=num_requests, failed=0)

        def observe(phase: str, outcome) -> None:
            failed[phase] += not outcome.success
            progress.update(tasks[phase], advance=1, failed=failed[phase])

        yield observe


def render_serve(document: dict[str, Any], percentiles: list[float]) -> None:
    """vLLM's "Serving Benchmark Result" block: a Rich table on a TTY, its plain-text layout when piped."""
    from llmctl.bench.metrics import summary_rows

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
    lines = ["{s:=^50}".format(s=" Serving Benchmark Result ")]
    lines += ["{s:-^50}".format(s=label) if value is None else f"{label + ':':<40}{value}" for label, value in rows]
    sys.stdout.write("\n".join(lines + ["=" * 50]) + "\n")


def print_load_errors(samples: list[dict[str, Any]], where: str = "") -> None:
    """One stderr line per kind of failed request (`bench serve`, `profile server`)."""
    for sample in samples:
        status = "no response" if sample["status"] is None else f"HTTP {sample['status']}"
        sys.stderr.write(f"llmctl: {where}{sample['count']} request(s) failed: {status}: {sample['message']}\n")


def render_sweep(document: dict[str, Any]) -> None:
    """One row per load point, then the highest load that met the targets."""
    headers = ["rate", "concurrency", "ok", "failed", "req/s", "out tok/s", "median TTFT ms", "p99 TTFT ms",
               "mean TPOT ms", "p99 E2EL ms", "targets"]
    rows = [[str(row["request_rate"]), str(row["max_concurrency"] or "-"), str(row["completed"]), str(row["failed"]),
             fmt(row["request_throughput"]), fmt(row["output_throughput"]), fmt(row.get("median_ttft_ms")),
             fmt(row.get("p99_ttft_ms")), fmt(row.get("mean_tpot_ms")), fmt(row.get("p99_e2el_ms")),
             "met" if row["meets_targets"] else "missed"] for row in document["sweep"]]
    _table(headers, rows, set(range(2, 10)))
    best = document["best_point"]
    line = ("no load point met the targets" if best is None else
            f"highest load meeting the targets: request rate {best['request_rate']}, max concurrency "
            f"{best['max_concurrency'] or 'unlimited'} ({fmt(best['request_throughput'])} req/s measured)")
    stdout_console().print(line, markup=False, highlight=False)


def print_serve_problems(document: dict[str, Any], max_failure_rate: float = 0.0) -> None:
    """Failures by cause, --slo verdicts and the --max-failure-rate verdict, per load point, on stderr."""
    rows = document.get("sweep") or [document]
    for row in rows:
        where = f"[rate {row['request_rate']}, concurrency {row['max_concurrency'] or 'unlimited'}] " if len(rows) > 1 else ""
        _print_point_problems(row, max_failure_rate, where)


def _print_point_problems(row: dict[str, Any], max_failure_rate: float, where: str) -> None:
    print_load_errors(row["error_samples"], where)
    for gate in row.get("slo", []):
        measured = "not measured" if gate["value"] is None else f"measured {gate['value']:.6g}"
        verdict = "passed" if gate["passed"] else "violated"
        sys.stderr.write(f"llmctl: {where}slo {verdict}: {gate['gate']} ({measured})\n")
    causes = ", ".join(f"{cause}: {count}" for cause, count in row["failures_by_cause"].items())
    if row["completed"] == 0:
        sys.stderr.write(f"llmctl: error: {where}all {row['failed']} requests failed ({causes})\n")
    elif row["failure_rate"] > max_failure_rate:
        sys.stderr.write(f"llmctl: error: {where}{row['failed']} of {row['completed'] + row['failed']} requests "
                         f"failed ({row['failure_rate']:.1%} > --max-failure-rate {max_failure_rate:g}): {causes}\n")
