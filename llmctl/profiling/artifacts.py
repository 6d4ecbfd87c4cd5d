"""Artifact folders of `llmctl profile`: one timestamped folder per run holding the profiler's files
and a `manifest.json` that says what ran (tool, version, exact command, PIDs, duration, exit status,
files). The manifest is written even when the run fails or is interrupted, so a half-finished
profile is still explained."""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from llmctl.errors import UserError

DEFAULT_ROOT = "llmctl-profiles"
MANIFEST = "manifest.json"


def default_output_dir(kind: str, now: Optional[_dt.datetime] = None, root: Path = Path(DEFAULT_ROOT)) -> Path:
    """`./llmctl-profiles/<kind>-<YYYYmmdd-HHMMSS>`, suffixed `-2`, `-3`... when that name is taken."""
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    candidate = root / f"{kind}-{stamp}"
    counter = 2
    while candidate.exists():
        candidate = root / f"{kind}-{stamp}-{counter}"
        counter += 1
    return candidate


def prepare_output_dir(path: Optional[Path], kind: str) -> Path:
    folder = Path(path) if path is not None else default_output_dir(kind)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output-dir {folder} exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK):
        raise UserError(f"cannot write to {folder}")
    return folder.resolve()


@dataclass
class Manifest:
    """What one profiling run did; `to_dict()` is the JSON written to manifest.json and printed by --json."""

    kind: str
    tool: str
    tool_version: Optional[str]
    command: list[str]
    output_dir: Path
    target_pids: list[int] = field(default_factory=list)
    workload_command: Optional[list[str]] = None
    started_at: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    duration_s: Optional[float] = None
    exit_status: Optional[int] = None
    status: str = "running"
    message: Optional[str] = None
    files: list[str] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def add_file(self, path: Path) -> None:
        """Record `path` (inside the output folder) if it was actually written."""
        path = Path(path)
        if path.exists():
            name = str(path.resolve().relative_to(self.output_dir)) if path.is_absolute() else str(path)
            if name not in self.files:
                self.files.append(name)

    def finish(self, status: str, exit_status: Optional[int] = None, message: Optional[str] = None) -> None:
        self.status = status
        self.exit_status = exit_status
        self.message = message
        self.duration_s = round(time.monotonic() - self._t0, 3)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "tool": {"name": self.tool, "version": self.tool_version},
            "command": self.command, "workload_command": self.workload_command, "target_pids": self.target_pids,
            "started_at": self.started_at, "duration_s": self.duration_s, "exit_status": self.exit_status,
            "status": self.status, "message": self.message, "output_dir": str(self.output_dir),
            "files": sorted(set(self.files) | {MANIFEST}), "result": self.result,
        }

    def write(self) -> Path:
        """Write manifest.json atomically (a reader never sees half a file)."""
        target = self.output_dir / MANIFEST
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        os.replace(tmp, target)
        return target
