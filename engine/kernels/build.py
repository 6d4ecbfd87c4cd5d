"""Building and loading the native kernel libraries: each is its .c files (and every header beside them) compiled
with the host's C compiler into one shared library, cached per source and header content, flags, compiler and CPU
(`-march=native`) under `$LLMCTL_CACHE_DIR` or `~/.cache/llmctl`, and loaded with ctypes. No compiler, a failed
build, or `LLMCTL_DISABLE_CPU_KERNELS=1` gives None, and the engine keeps its torch paths."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
DISABLE_ENV = "LLMCTL_DISABLE_CPU_KERNELS"


def _cache_dir() -> Path:
    explicit = os.environ.get("LLMCTL_CACHE_DIR")
    if explicit:
        return Path(explicit) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmctl" / "kernels"


def _cpu_signature() -> str:
    """The CPU's feature flags: a library built with -march=native must not run on another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _inputs(sources: Sequence[Path]) -> list[Path]:
    """The files a build reads: its sources, then every header in their folders (an edited header rebuilds)."""
    headers = sorted({header for source in sources for header in source.parent.glob("*.h")})
    return [*sources, *headers]


def _build(compiler: str, sources: Sequence[Path], flags: tuple[str, ...], name: str) -> Path:
    """The shared library `name` built from `sources` with `flags` (cached per input content, flags, compiler and
    CPU)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    contents = [f"{path.name}\0{path.read_text()}" for path in _inputs(sources)]
    key = hashlib.sha256("\0".join([*contents, " ".join(flags), version, _cpu_signature()]).encode())
    target = _cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent engines never load a half-written library.
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        result = subprocess.run([compiler, *flags, "-o", partial, *(str(s) for s in sources)], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "compiler failed")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def disabled() -> bool:
    """`LLMCTL_DISABLE_CPU_KERNELS=1`: every native kernel off (the torch paths run)."""
    return os.environ.get(DISABLE_ENV, "") not in ("", "0")


def find_compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_library(sources: Union[Path, Sequence[Path]], flags: tuple[str, ...], what: str,
                  name: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """`sources` (one .c file or several, compiled into one library named `name`, by default the first's stem)
    built with `flags` and loaded, or None (logged, naming `what` falls back) when the kernels are disabled, there
    is no compiler, or the build or load fails."""
    sources = [sources] if isinstance(sources, Path) else list(sources)
    if disabled():
        return None
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C compiler found: %s", what)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, sources, flags, name or sources[0].stem)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native kernels unavailable (%s): %s", exc, what)
        return None
