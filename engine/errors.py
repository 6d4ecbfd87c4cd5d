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
