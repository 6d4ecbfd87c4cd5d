"""Engine error types. Each carries `user_error = True` when the caller can fix it, so the CLI
shows one line and the server maps it to a 400-class response."""

from __future__ import annotations


class EngineError(Exception):
    user_error = False


class EngineArgsError(EngineError, ValueError):
    """An engine argument is invalid (names the argument and the allowed values)."""

    user_error = True


class ModelLoadError(EngineError):
    """A model folder or checkpoint cannot be loaded (names the file or tensor at fault)."""

    user_error = True


class InvalidRequestError(EngineError, ValueError):
    """A request cannot be served as asked (prompt too long, token id out of range, ...)."""

    user_error = True


class EngineOverloadedError(EngineError):
    """The waiting queue is full: the request was refused at once rather than queued forever."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(EngineError):
    """The request ran past its deadline and was aborted (its KV blocks are free)."""


class StepFailedError(EngineError):
    """The engine step running this request raised; the request was aborted, the engine serves on."""


class EngineDeadError(EngineError):
    """The engine hit a fatal failure and no longer serves requests."""
