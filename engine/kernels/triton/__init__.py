"""Triton kernels for CUDA (and, for tests, the Triton interpreter on CPU tensors).

Importing this package never imports triton: the engine runs where triton is not installed. A kernel
module of it (`attention.py`, `cache.py`, ...) imports triton at its own import, which a caller does
only once `triton_usable` says yes. Triton reads `TRITON_INTERPRET=1` (run kernels interpreted, on CPU
tensors too) when it is first imported: it must be set before anything in the process imports triton.
"""

from __future__ import annotations

import os

import torch

INTERPRET_ENV = "TRITON_INTERPRET"


def triton_importable() -> bool:
    """Whether `import triton` works (a broken build counts as absent)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - an undefined symbol or a missing CUDA library means "not available"
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get(INTERPRET_ENV) == "1"


def triton_usable(device: torch.device) -> bool:
    """Triton kernels can run on `device`: CUDA with triton importable, or any device under the interpreter."""
    if device.type != "cuda" and not interpreter_enabled():
        return False
    return triton_importable()
