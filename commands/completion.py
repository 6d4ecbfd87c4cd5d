"""`llmctl completion SHELL`: print a static completion script for bash, zsh or fish."""

from __future__ import annotations

import typer

from llmctl.completion import SHELLS


def completion(
    shell: str = typer.Argument(..., help="bash, zsh or fish."),
) -> None:
    """Print a shell completion script (bash, zsh or fish)."""
    from llmctl.cli import build_cli
    from llmctl.completion import render
    from llmctl.errors import UserError

    if shell not in SHELLS:
        raise UserError(f"unknown shell {shell!r}; choose one of {', '.join(SHELLS)}")
    typer.echo(render(shell, build_cli()), nl=False)
