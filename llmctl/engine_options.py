"""Engine flags, declared once: built from the `EngineArgs` fields (name, type, default, help) for
every command that runs the engine (`generate`, `serve`, `bench throughput`, `bench latency`,
`profile torch`, `profile leak`).

Flag names are the field names with dashes, as in `vllm serve` (`max_model_len` ->
`--max-model-len`); the help text and choices are the field's metadata (`engine/args.py`). A
command takes them with `@with_engine_flags(...)` and one parameter whose default is `FLAGS`: the
flags stand in the help page where that parameter stands, and the command receives the validated
`EngineArgs` in it. Keyword arguments of the decorator change a flag's default for that command
(`bench` measures without prefix caching unless asked).
"""

from __future__ import annotations

import enum
import functools
import inspect
import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Annotated, Any, Callable, Optional, get_type_hints

import typer

from llmctl.config import choice_type
from llmctl.engine.args import EngineArgs

PANEL = "Engine"
# The model id `llmctl serve` gives the embedded model; clients that ship with llmctl (bench serve)
# find the same tokenizer locally by it.
EMBEDDED_MODEL_ID = "llmctl-default"


class _Slot:
    def __repr__(self) -> str:
        return "FLAGS"


# The default of the one parameter that receives the `EngineArgs` (see the module docstring).
FLAGS: Any = _Slot()


def _flag_names(field_name: str, default: Any, short: Optional[str], negatable: bool = False) -> list[str]:
    flag = "--" + field_name.replace("_", "-")
    if default is True or negatable:  # on by default (or by a per-device default): the flag needs its off switch
        flag = f"{flag}/--no-{flag[2:]}"
    return [flag, short] if short else [flag]


def _field_flags(f: Any) -> list[str]:
    """An `EngineArgs` field's flag spellings (with its off switch where it has one)."""
    return _flag_names(f.name, f.default, f.metadata.get("short"), f.metadata.get("negatable", False))


def _flag_parameter(f: Any, annotation: Any, default: Any) -> inspect.Parameter:
    meta = f.metadata
    if "cli_type" in meta:  # a field that also takes Python values (a mapping) reads a string on the command line
        annotation = Optional[meta["cli_type"]]
    if "choices" in meta:
        annotation = choice_type("".join(part.title() for part in f.name.split("_")), meta["choices"])
        default = annotation(default)
    extra = {"parser": _json_text} if "cli_type" in meta else {}
    option = typer.Option(*_field_flags(f), help=meta["help"],
                          rich_help_panel=PANEL, **extra)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[annotation, option])


def _json_text(value: Any) -> Any:
    """A mapping from the YAML config (`speculative-config:`) as the JSON text the flag reads on the command line."""
    return json.dumps(value) if isinstance(value, Mapping) else value


def engine_flag(name: str, **option: Any) -> Any:
    """One engine flag as a parameter type, for a command that takes it without running the engine
    (`bench --cpu --num-threads N`): the same name, type and help, outside the Engine panel."""
    f = next((f for f in flag_fields() if f.name == name), None)
    if f is None:
        raise TypeError(f"not an engine flag: {name}")
    return Annotated[get_type_hints(EngineArgs)[name],
                     typer.Option(*_field_flags(f), help=f.metadata["help"], **option)]


def flag_fields() -> list[Any]:
    """The `EngineArgs` fields that are CLI flags (those with help text), in declaration order."""
    return [f for f in fields(EngineArgs) if "help" in f.metadata]


def flag_parameters(**defaults: Any) -> list[inspect.Parameter]:
    """One keyword parameter per engine flag, with `defaults` replacing the fields' defaults."""
    flagged = flag_fields()
    unknown = sorted(set(defaults) - {f.name for f in flagged})
    if unknown:
        raise TypeError(f"not engine flags: {', '.join(unknown)}")
    hints = get_type_hints(EngineArgs)
    return [_flag_parameter(f, hints[f.name], defaults.get(f.name, f.default)) for f in flagged]


def with_engine_flags(**defaults: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the engine flags in place of its `FLAGS` parameter, which receives `EngineArgs`."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(func, eval_str=True)
        slot = next((name for name, p in signature.parameters.items() if p.default is FLAGS), None)
        if slot is None:
            raise TypeError(f"{func.__qualname__} has no parameter defaulting to engine_options.FLAGS")
        kind = signature.parameters[slot].kind  # the flags take the slot's place, so its kind too
        flags = [p.replace(kind=kind) for p in flag_parameters(**defaults)]
        names = [p.name for p in flags]
        params = [q for p in signature.parameters.values() for q in (flags if p.name == slot else [p])]

        @functools.wraps(func)
        def command(**values: Any) -> Any:
            values[slot] = engine_args(**{name: values.pop(name) for name in names})
            return func(**values)

        command.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def missing_tokenizer(args) -> Optional[str]:
    """The folder a tokenizer.json was expected in when there is none (a `--load-format dummy` folder
    often holds only config.json), else None. `args`: `EngineArgs`, or a fallback model (no revision)."""
    from pathlib import Path

    from llmctl.engine.errors import ModelLoadError
    from llmctl.engine.hub import resolve_model_folder

    name = args.tokenizer or args.model
    try:  # a cached model id's snapshot folder, else the path given
        folder = None if name is None else resolve_model_folder(name, None if args.tokenizer else getattr(args, "revision", None))
    except ModelLoadError:
        return None  # a model id not cached is the loader's error to report
    if folder is None or not folder.is_dir() or (folder / "tokenizer.json").is_file():
        return None  # the embedded model has one; a missing folder is the loader's error to report
    return str(folder)


def default_model_name(model: Optional[str]) -> str:
    """The id a server reports for `model` by default: a model id as given (vLLM's), a folder's name."""
    from pathlib import Path

    from llmctl.engine.hub import is_repo_id

    if model is None:
        return EMBEDDED_MODEL_ID
    return model if is_repo_id(model) else Path(model).resolve().name


def engine_args(**values: Any) -> EngineArgs:
    """Build `EngineArgs` from the parsed flags (enum values unwrapped)."""
    cleaned = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in values.items()}
    return EngineArgs.from_dict(cleaned)


def flags_markdown() -> str:
    """The engine flags as the Markdown table in docs/engine.md (`python tools/gen_engine_docs.py` writes it)."""
    rows = ["| flag | default | values | what it sets |", "|---|---|---|---|"]
    for f in flag_fields():
        spellings = _field_flags(f)
        names = " ".join(f"`{name}`" for spelling in spellings for name in spelling.split("/"))
        choices = ", ".join(f"`{c}`" for c in f.metadata.get("choices", ()))
        default = "—" if f.default is None else f"`{str(f.default).lower() if isinstance(f.default, bool) else f.default}`"
        rows.append(f"| {names} | {default} | {choices} | {f.metadata['help'].replace('|', '&#124;')} |")
    return "\n".join(rows)
