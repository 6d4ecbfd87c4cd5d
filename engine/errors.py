"""Engine error types. Each carries `user_error = True` when the caller can fix it, so the CLI
shows one line and the server maps it to a 400-class response."""

from __future__ import annotations

from typing import Optional


class EngineError(Exception):
    user_error = False


class EngineArgsError(EngineError, ValueError):
    """An engine argument is invalid (names the argument and the allowed values)."""

    user_error = True


class ModelLoadError(EngineError):
    """A model folder or checkpoint cannot be loaded (names the file or tensor at fault)."""

    user_error = True


class InvalidRequestError(EngineError, ValueError):
    """A request cannot be served as asked (prompt too long, token id out of range, ...). `param`
    names the request field at fault (`SamplingParams`' names, "prompt", "messages"), so the server
    answers with it instead of guessing it from the message."""

    user_error = True

    def __init__(self, message: str, *, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class EngineOverloadedError(EngineError):
    """The waiting queue is full: the request was refused at once rather than queued forever."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(EngineError):
    """The request ran past its deadline and was aborted (its KV blocks are free)."""


class StreamBacklogError(EngineError):
    """A stream's reader left more output unread than `max_stream_backlog_tokens`: its request was aborted."""


class CapacityError(EngineError):
    """The request does not fit in device memory even alone at the smallest prefill chunk; it was
    finished (its KV blocks are free) and the engine serves on. Retrying may succeed once memory
    held elsewhere is released."""

    def __init__(self, message: str, retry_after_s: int = 10):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StepFailedError(EngineError):
    """The engine step running this request raised; the request was aborted, the engine serves on."""


class EngineDeadError(EngineError):
    """The engine hit a fatal failure and no longer serves requests."""


class RankFailedError(EngineDeadError):
    """A rank of a multi-rank (tensor- or pipeline-parallel) engine died, hung past the collective timeout, or
    failed inside a step: the ranks are out of step, so the engine stops (the server reports unhealthy and
    exits non-zero)."""


# What torch raises when an allocation fails: `torch.OutOfMemoryError` (CUDA, and other devices'
# caching allocators), a plain RuntimeError from the CPU allocator ("[enforce fail at
# alloc_cpu.cpp:127] ... DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes"
# in torch 2.13), or Python's MemoryError from a host-side list or buffer.
_CPU_ALLOCATION_FAILURE = "can't allocate memory"


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocation failure: a capacity problem the engine recovers from by shrinking the
    step, not a bug."""
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
        return True
    return isinstance(exc, RuntimeError) and _CPU_ALLOCATION_FAILURE in str(exc)
