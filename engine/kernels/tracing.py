"""`profiled`: a native entry point labelled in torch.profiler traces."""

from __future__ import annotations

from functools import wraps
from typing import Callable, TypeVar

import torch

_Function = TypeVar("_Function", bound=Callable)


def profiled(name: str) -> Callable[[_Function], _Function]:
    """Label a native entry point `llmctl::<name>` in torch.profiler traces, which cannot see inside a C call.
    Checked per call: an unconditional `record_function` costs ~9 us, the check ~0.06 us."""
    label = f"llmctl::{name}"

    def wrap(function: _Function) -> _Function:
        @wraps(function)
        def traced(*args, **kwargs):
            if not torch.autograd._profiler_enabled():
                return function(*args, **kwargs)
            with torch.profiler.record_function(label):
                return function(*args, **kwargs)
        return traced  # type: ignore[return-value]

    return wrap
