"""Rewrite completions/ from the Typer app: `python tools/gen_completions.py`."""

from __future__ import annotations

from pathlib import Path

from llmctl.cli import build_cli
from llmctl.completion import SHELLS, render

FILE_NAMES = {"bash": "llmctl.bash", "zsh": "_llmctl", "fish": "llmctl.fish"}


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "completions"
    out.mkdir(exist_ok=True)
    command = build_cli()
    for shell in SHELLS:
        (out / FILE_NAMES[shell]).write_text(render(shell, command))
        print(f"wrote completions/{FILE_NAMES[shell]}")


if __name__ == "__main__":
    main()
