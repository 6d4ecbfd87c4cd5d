"""`bench serve --plot`: TTFT, TPOT and E2E latency histograms and output throughput over time for
one run; for a sweep, the load curve (latency against throughput, a marker per point).

matplotlib is imported inside the functions (Agg backend, no display needed) so that neither the
CLI's start-up nor a benchmark without --plot pays for it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from llmctl.bench.metrics import RequestOutcome, output_timeline
from llmctl.errors import UserError

FORMATS = (".png", ".svg", ".pdf")


def check_plot_path(path: Path) -> None:
    """Fail before the benchmark runs, not after: format, folder, and matplotlib itself."""
    if Path(path).suffix.lower() not in FORMATS:
        raise UserError(f"--plot {path}: the file name must end in one of {', '.join(FORMATS)}")
    if not Path(path).resolve().parent.is_dir():
        raise UserError(f"--plot {path}: folder {Path(path).resolve().parent} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'llmctl[bench]'") from None


def _histogram(axes, values_s: list[float], title: str) -> None:
    values = [v * 1000.0 for v in values_s]
    if values:
        axes.hist(values, bins=min(40, max(5, len(values) // 2)), color="tab:blue", alpha=0.8)
        axes.axvline(statistics.median(values), color="tab:red", linestyle="--", label="median")
        axes.legend(loc="upper right")
    else:
        axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
    axes.set_title(title)
    axes.set_xlabel("ms")
    axes.set_ylabel("requests")


def write_plot(path: Path, outcomes: list[RequestOutcome], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    done = [out for out in outcomes if out.success]
    figure, grid = plt.subplots(2, 2, figsize=(12, 8))
    _histogram(grid[0][0], [out.ttft for out in done], "Time to first token")
    _histogram(grid[0][1], [out.tpot for out in done if out.tpot is not None], "Time per output token")
    _histogram(grid[1][0], [out.latency for out in done], "End-to-end latency")
    timeline = output_timeline(outcomes)
    axes = grid[1][1]
    if timeline:
        axes.stairs(timeline, range(len(timeline) + 1), color="tab:green", fill=True, alpha=0.6)
    axes.set_title("Output throughput (1 s buckets)")
    axes.set_xlabel("seconds since start")
    axes.set_ylabel("tokens/s")
    figure.suptitle(title)
    figure.tight_layout()
    _save(figure, path)


def write_sweep_plot(path: Path, rows: list[dict], title: str) -> None:
    """The load curve of a sweep: latency against measured throughput, one marker per load point."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    points = sorted((row for row in rows if row["completed"]), key=lambda row: row["request_throughput"])
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    x = [row["request_throughput"] for row in points]
    for key, label in (("median_ttft_ms", "median TTFT"), ("p99_ttft_ms", "P99 TTFT"), ("p99_e2el_ms", "P99 E2EL")):
        if points and key in points[0]:
            left.plot(x, [row[key] for row in points], marker="o", label=label)
    points_tpot = [row for row in points if "mean_tpot_ms" in row]  # absent when --percentile-metrics drops it
    right.plot([row["output_throughput"] for row in points_tpot], [row["mean_tpot_ms"] for row in points_tpot],
               marker="o", color="tab:purple", label="mean TPOT")
    for row in points_tpot:
        right.annotate(f"{row['request_rate']}/{row['max_concurrency'] or '∞'}",
                       (row["output_throughput"], row["mean_tpot_ms"]), fontsize=7)
    _labels(left, "request throughput (req/s)", "latency (ms)")
    _labels(right, "output throughput (tok/s)", "time per output token (ms)")
    figure.suptitle(title + "  (labels: request rate / max concurrency)")
    figure.tight_layout()
    _save(figure, path)


def _labels(axes, xlabel: str, ylabel: str) -> None:
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(loc="best")


def _save(figure, path: Path) -> None:
    import matplotlib.pyplot as plt

    try:
        figure.savefig(path, dpi=100)
    except OSError as exc:
        raise UserError(f"cannot write --plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)
