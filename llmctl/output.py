"""Terminal and machine-readable output shared by every subcommand.

Rich consoles honour NO_COLOR and turn colour and live widgets off when the stream is not a TTY;
`--json` output goes to stdout as plain JSON with nothing else on that stream.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from rich.console import Console


def stdout_console() -> Console:
    return Console(highlight=False, soft_wrap=True)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def is_interactive(console: Console) -> bool:
    """Live widgets (progress bars, spinners) only on a real terminal."""
    return console.is_terminal and not os.environ.get("CI")


def print_json(obj: Any, *, stream=None) -> None:
    stream = stream or sys.stdout
    stream.write(json.dumps(obj, ensure_ascii=False, default=_json_default) + "\n")
    stream.flush()


def _json_default(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def configure_logging(level: str) -> None:
    """Log to stderr: Rich formatting on a TTY, plain single lines when piped."""
    console = stderr_console()
    if console.is_terminal:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=console, show_path=False, markup=False)
        fmt = "%(message)s"
    else:
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger("llmctl")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(num_bytes: float) -> str:
    """A size for people, in binary units: `512 B`, `12.3 MiB`, `256 MiB`, `1.5 GiB` (one decimal,
    dropped when it is 0)."""
    value = float(num_bytes)
    for unit in BYTE_UNITS:
        if abs(value) < 1024 or unit == BYTE_UNITS[-1]:
            break
        value /= 1024
    text = f"{value:.1f}"
    return f"{text[:-2] if text.endswith('.0') else text} {unit}"
