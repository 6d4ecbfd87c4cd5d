"""User-facing error types shared by the CLI and the libraries below it.

Anything raised as a `UserError` (or an engine error carrying `user_error = True`) is shown
as one line on stderr with exit code 2 instead of a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix: bad flag value, missing file, unusable model."""

    exit_code = 2
    user_error = True

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


def is_user_error(exc: BaseException) -> bool:
    return bool(getattr(exc, "user_error", False))


def one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())
