"""Where option values come from: CLI flag > `LLMCTL_*` environment > YAML `--config` > default.

Click already resolves flag > envvar > `ctx.default_map` > default; this module feeds the YAML file
into `default_map` (an eager `--config` option) and names every option's environment variable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
import yaml

ENV_PREFIX = "LLMCTL_"


def env_var_name(param_name: str) -> str:
    return ENV_PREFIX + param_name.upper()


def load_yaml_config(path: Path) -> dict[str, Any]:
    """Read a YAML mapping whose keys are long flag names (`max-model-len` or `max_model_len`)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise typer.BadParameter(f"cannot read config file {path}: {exc.strerror or exc}")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise typer.BadParameter(f"config file {path} is not valid YAML{where}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise typer.BadParameter(f"config file {path} must be a mapping of flag names to values")
    return {str(key).lstrip("-").replace("-", "_"): value for key, value in data.items()}


def _apply_config(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Path]) -> Optional[Path]:
    if value is None:
        return None
    data = load_yaml_config(value)
    known = {p.name for p in ctx.command.params if p.name and p.name != "config"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise typer.BadParameter(
            f"unknown key(s) in {value}: {', '.join(unknown)}; keys are this command's long flag names"
        )
    ctx.default_map = {**(ctx.default_map or {}), **data}
    return value


ConfigOption = typer.Option(
    None,
    "--config",
    help="YAML file of option values (keys are the long flag names). Flags and LLMCTL_* env vars win over it.",
    is_eager=True,
    callback=_apply_config,
    dir_okay=False,
)


def assign_env_vars(command: Any) -> None:
    """Give every option of every command (a click-style tree) its `LLMCTL_<NAME>` environment variable."""
    for param in command.params:
        if param.param_type_name == "option" and param.name and not param.envvar:
            if param.name in {"help", "version", "install_completion", "show_completion"}:
                continue
            param.envvar = env_var_name(param.name)
    for sub in getattr(command, "commands", {}).values():
        assign_env_vars(sub)
