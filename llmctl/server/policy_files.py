"""The YAML files of `--api-keys`, `--output-filter` and `--input-filter`: one mapping with one
list (`keys:` or `rules:`) of named entries. Owns reading them, so every such file fails the same
way: one line naming the flag, the file, and the entry (or YAML line) at fault."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

Entry = TypeVar("Entry")


class PolicyFileError(ValueError):
    """A policy file cannot be used; the message names the file, the entry and what to fix."""


def read_entries(path: Path, flag: str, key: str, parse: Callable[[object, str], Entry],
                 error: type[PolicyFileError]) -> list[Entry]:
    """The entries of `path`'s `key` list, each made by `parse(raw entry, where)`; names unique."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{flag} {path}: cannot read it ({exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise error(f"{flag} {path} is not valid YAML{where}") from None
    if not isinstance(data, dict) or set(data) != {key} or not isinstance(data[key], list) or not data[key]:
        raise error(f"{flag} {path}: expected a mapping with one key, '{key}', holding a non-empty list")
    entries, names = [], set()
    for index, raw in enumerate(data[key]):
        entry = parse(raw, f"{flag} {path}: {key}[{index}]")
        if entry.name in names:  # type: ignore[attr-defined]
            raise error(f"{flag} {path}: the name {entry.name!r} is used twice")  # type: ignore[attr-defined]
        names.add(entry.name)  # type: ignore[attr-defined]
        entries.append(entry)
    return entries
