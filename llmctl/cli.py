"""The `llmctl` Typer application: global options, subcommand registration, error handling.

Subcommand modules live in `llmctl.commands`; each is thin (parse, call a library, render) and
imports heavy libraries such as torch only inside its function, so `--help` stays fast.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import typer
from typer._click import exceptions as click_errors  # typer 0.29 vendors click

from llmctl.__about__ import __version__
from llmctl import help as help_format
from llmctl.config import assign_env_vars, config_value_error
from llmctl.errors import is_user_error, one_line

app = typer.Typer(
    cls=help_format.Group,
    name="llmctl",
    help="One toolkit for LLM inference hosts: generate, serve, bench, profile, doctor.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"llmctl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Optional[bool] = typer.Option(
        None, "--version", help="Print the version and exit.", is_eager=True, callback=_version_callback
    ),
    log_level: str = typer.Option(
        "warning", "--log-level", help="Logging level on stderr: debug, info, warning, error."
    ),
) -> None:
    """One toolkit for LLM inference hosts: generate, serve, bench, profile, doctor."""
    from llmctl.output import configure_logging

    if log_level.lower() not in {"debug", "info", "warning", "error", "critical"}:
        raise typer.BadParameter("choose one of debug, info, warning, error", param_hint="--log-level")
    configure_logging(log_level)


def _register_commands() -> None:
    from llmctl.commands import completion, generate

    app.command("generate", cls=help_format.Command)(generate.generate)
    app.command("completion", cls=help_format.Command)(completion.completion)
    app.command("doctor", cls=help_format.Command)(__import__("llmctl.commands.doctor", fromlist=["doctor"]).doctor)
    app.add_typer(__import__("llmctl.commands.profile", fromlist=["profile_app"]).profile_app, name="profile")
    app.command("serve", cls=help_format.Command)(__import__("llmctl.commands.serve", fromlist=["serve"]).serve)
    app.add_typer(__import__("llmctl.commands.bench", fromlist=["bench_app"]).bench_app, name="bench")


_register_commands()


def build_cli() -> typer.core.TyperGroup:
    """The click command tree with every option's `LLMCTL_*` environment variable assigned."""
    command = typer.main.get_command(app)
    assign_env_vars(command)
    return command


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"llmctl: error: {message}\n")
    sys.stderr.flush()
    return code


def run(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI and return its exit code; user errors become one line on stderr."""
    command = build_cli()
    try:
        result = command.main(args=list(argv) if argv is not None else None, prog_name="llmctl", standalone_mode=False)
    except click_errors.NoArgsIsHelpError as exc:  # `llmctl`, `llmctl profile`: the help page, exit 0
        sys.stdout.write(exc.format_message() + "\n")
        return 0
    except click_errors.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
        return _fail(one_line(config_value_error(exc) or exc.format_message()) + hint, exc.exit_code)
    except typer.Exit as exc:
        return exc.exit_code
    except click_errors.ClickException as exc:
        return _fail(one_line(exc.format_message()), exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.stderr.write("llmctl: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # noqa: BLE001 - the one place errors become exit codes
        if is_user_error(exc):
            return _fail(one_line(exc), getattr(exc, "exit_code", 2))
        raise
    return result if isinstance(result, int) else 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
