"""Where option values come from: CLI flag > `LLMCTL_*` environment > YAML `--config` > default.

Click already resolves flag > envvar > `ctx.default_map` > default; this module feeds the YAML file
into `default_map` (an eager `--config` option) and names every option's environment variable.

One rule for environment names: an option's variable is `LLMCTL_` + its long flag name
(`--max-model-len` -> `LLMCTL_MAX_MODEL_LEN`, `--json` -> `LLMCTL_JSON`), and a name means one
thing in every command that reads it. Where a command gives a flag another meaning, that command's
option carries `LLMCTL_<COMMAND>_<FLAG>` instead (`profile cpu --port` attaches to a process, so it
reads `LLMCTL_PROFILE_PORT`, not the `LLMCTL_PORT` that `serve` listens on). `SHARED_ENV_MEANINGS`
says what each name read by several commands with different help texts means; the test
`tests/test_cli.py::test_every_env_name_has_one_meaning` holds every command to it.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Optional

import typer
import yaml
from typer._click.core import ParameterSource  # typer 0.29 vendors click

ENV_PREFIX = "LLMCTL_"
# Read by the library, not by an option: no option may take these names.
PROCESS_ENV_NAMES = ("LLMCTL_CACHE_DIR", "LLMCTL_DISABLE_CPU_KERNELS", "LLMCTL_KEEP_MALLOC_DEFAULTS",
                     "LLMCTL_TRAIN_CORPUS")
# Names several commands read, with help texts that differ per command: the one meaning of each.
SHARED_ENV_MEANINGS = {
    "LLMCTL_API_KEY": "the llmctl server's API key: serve requires it, bench serve and profile server send it",
    "LLMCTL_BASE_URL": "root URL of the server a client command talks to",
    "LLMCTL_BATCH_SIZE": "requests run together as one batch",
    "LLMCTL_COMPARE_HF": "also run transformers' generate on the same workload",
    "LLMCTL_DRY_RUN": "print what would run and run nothing",
    "LLMCTL_DURATION": "seconds to sample a process",
    "LLMCTL_GPU_MEMORY_UTILIZATION": "fraction of each GPU's memory the engine may use (doctor: plans with it)",
    "LLMCTL_IGNORE_EOS": "keep generating past end-of-sequence",
    "LLMCTL_INPUT_LEN": "prompt tokens per request",
    "LLMCTL_PROFILE_PORT": "TCP port of the server (or other process) a profile command targets",
    "LLMCTL_OUTPUT_LEN": "generated tokens per request",
    "LLMCTL_JSON": "print machine-readable JSON on stdout instead of the human report",
    "LLMCTL_MAX_CONCURRENCY": "most requests in flight at once (bench serve: a comma list sweeps)",
    "LLMCTL_MODEL": "the Hugging Face model folder the engine runs (doctor: sizes its disk-space check)",
    "LLMCTL_NATIVE": "include native (C/C++) frames in a profile",
    "LLMCTL_NUM_PROMPTS": "number of requests sent",
    "LLMCTL_RANDOM_INPUT_LEN": "prompt length of random requests sent to a server",
    "LLMCTL_RANDOM_OUTPUT_LEN": "max_tokens of random requests sent to a server",
    "LLMCTL_REQUEST_RATE": "requests per second sent to a server (inf: all at once; bench serve: a comma list sweeps)",
    "LLMCTL_ROW_LIMIT": "rows of a profile's operator table",
    "LLMCTL_TEMPERATURE": "sampling temperature",
    "LLMCTL_TOKENIZER": "tokenizer folder (bench serve: or a Hugging Face id in the local cache)",
    "LLMCTL_WARMUP": "leading steps or iterations left out of a measurement",
}


def choice_type(name: str, choices: tuple[str, ...]) -> type[enum.Enum]:
    """A flag type taking one of `choices`: a str Enum, so the help shows them (`<fcfs|priority>`), the
    parser refuses others and the completions offer them."""
    return enum.Enum(name, {choice: choice for choice in choices}, type=str)


def long_flag(param: Any) -> str:
    """The option's first long flag (`--max-model-len`), or its name when it has none."""
    return next((opt for opt in param.opts if opt.startswith("--")), "--" + param.name.replace("_", "-"))


def env_var_name(flag: str) -> str:
    """`--max-model-len` -> `LLMCTL_MAX_MODEL_LEN`: named after the flag users type, not the parameter."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _config_key(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


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
    # YAML keys are long flag names (`json`, `stop-token-id`); default_map is keyed by parameter names.
    params = {_config_key(long_flag(p)): p.name for p in ctx.command.params
              if p.param_type_name == "option" and p.name and p.name != "config"}
    unknown = sorted(set(data) - set(params))
    if unknown:
        raise typer.BadParameter(
            f"unknown key(s) in {value}: {', '.join(unknown)}; keys are this command's long flag names"
        )
    # A mapping stays a mapping: flags that read one take it through their parser (doctor's `thresholds:`,
    # the engine's `speculative-config:`).
    ctx.default_map = {**(ctx.default_map or {}), **{params[key]: item for key, item in data.items()}}
    return value


def config_value_error(exc: Any) -> Optional[str]:
    """The message for a bad value that came from the YAML file, naming the file and its key.

    Click's own message blames the option's environment variable even when the value came from
    `--config` ("Invalid value for '--max-tokens' (env var: 'LLMCTL_MAX_TOKENS')").
    """
    ctx, param = getattr(exc, "ctx", None), getattr(exc, "param", None)
    if ctx is None or param is None or not param.name:
        return None
    if ctx.get_parameter_source(param.name) is not ParameterSource.DEFAULT_MAP or not ctx.params.get("config"):
        return None
    return f"config file {ctx.params['config']}: invalid value for '{long_flag(param).lstrip('-')}': {exc.message}"


ConfigOption = typer.Option(
    None,
    "--config",
    help="YAML file of option values (keys are the long flag names). Flags and LLMCTL_* env vars win over it.",
    is_eager=True,
    callback=_apply_config,
    dir_okay=False,
)


def assign_env_vars(command: Any) -> None:
    """Give every option of every command (a click-style tree) its `LLMCTL_<FLAG>` environment variable.

    Options that declare a per-command name (`envvar="LLMCTL_PROFILE_PORT"`) keep it.
    """
    for param in command.params:
        if param.param_type_name == "option" and param.name and not param.envvar:
            if param.name in {"help", "version", "install_completion", "show_completion"}:
                continue
            param.envvar = env_var_name(long_flag(param))
    for sub in getattr(command, "commands", {}).values():
        assign_env_vars(sub)
