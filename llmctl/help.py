"""Help pages: click's plain definition lists, options grouped under their panels.

Typer's Rich option table sizes its columns to the terminal and cuts what does not fit with an
ellipsis: at 80 columns `llmctl serve --help` showed `--max-num-batch…` and `--gpu-memory-ut…`.
Click's definition list never cuts the flag column; it wraps the help text beside it, or starts it
on the next line when the flag is long. Boolean flags show no value placeholder: they take none
(`--json`, as `vllm serve`'s store_true flags); their environment variables take 1/0, true/false.
"""

from __future__ import annotations

from typer._click import Context, HelpFormatter
from typer.core import TyperCommand, TyperGroup

OPTIONS_PANEL = "Options"


def _fitted(param, ctx: Context, record: tuple[str, str], width: int) -> tuple[str, str]:
    """A flag column too wide for the page (a long list of choices) moves its choices into the help."""
    flags, help_text = record
    choices = getattr(getattr(param, "type_descriptor", None), "choices", None)
    if len(flags) + 2 <= width or not choices:
        return record
    names = ", ".join(str(getattr(c, "value", c)) for c in choices)
    text, brackets, extra = help_text.partition("  [")
    return flags.replace(param.display_type_rich(ctx), "<choice>"), f"{text} Choices: {names}.{brackets}{extra}"


def _write_panels(command, ctx: Context, formatter: HelpFormatter) -> None:
    panels: dict[str, list[tuple[str, str]]] = {}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        record = _fitted(param, ctx, record, formatter.width)
        if param.param_type_name == "argument":
            panel = "Arguments"
        else:
            panel = getattr(param, "rich_help_panel", None) or OPTIONS_PANEL
        panels.setdefault(panel, []).append(record)
    for panel, rows in panels.items():
        with formatter.section(panel):
            formatter.write_dl(rows)


class Command(TyperCommand):
    """A subcommand whose help is plain text in panels (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rich_markup_mode = None

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        _write_panels(self, ctx, formatter)


class Group(TyperGroup):
    """A command group whose help is plain text in panels, then its subcommands."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rich_markup_mode = None

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        _write_panels(self, ctx, formatter)
        self.format_commands(ctx, formatter)
