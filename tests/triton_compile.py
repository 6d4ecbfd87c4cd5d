"""Compiling a test module's Triton kernels for a CUDA GPU in a fresh process without the interpreter (no GPU
needed): what the interpreter ran has no interpreter-only construct."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def assert_compiles_for_cuda(module: str, cache_dir: Path, capability: int = 90, **env_extra: str) -> None:
    """Run `module.compile_for_cuda(capability)` in a subprocess; exit 3 means this triton lacks the entry points."""
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir), **env_extra)
    script = f"import sys; sys.path.insert(0, 'tests'); from {module} import compile_for_cuda; " \
             f"compile_for_cuda({capability})"
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode == 3:
        pytest.skip("this triton has not the compiler entry points (ASTSource, GPUTarget) the check uses")
    assert proc.returncode == 0, proc.stderr[-3000:]
