"""The grammar backend protocol: what the engine needs from a structured-output library (xgrammar's shape).

A backend compiles a `StructuredOutputsParams` once into an opaque compiled grammar, makes one matcher per
sequence from it, and owns the token bitmask format: `allocate_bitmask` (every token allowed),
`Matcher.fill_bitmask` (one row: the tokens the grammar allows next), `fill_bitmasks` (many rows, each from its
matcher, in one call), `batch_bitmask` (a buffer reused step after step) and `apply_bitmask` (disallowed
logits to -inf, in place, for the listed rows at once).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from llmctl.engine.sampling_params import StructuredOutputsParams


class GrammarCompileError(ValueError):
    """The backend cannot compile a spec; the message names the construct (the library's words, cleaned)."""


class Matcher(Protocol):
    def accept_token(self, token_id: int) -> bool: ...  # False: the grammar does not allow it (state unchanged)

    def rollback(self, num_tokens: int) -> None: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def is_terminated(self) -> bool: ...  # accepted a stop token at the grammar's end


class StructuredOutputBackend(Protocol):
    name: str

    def compile(self, spec: StructuredOutputsParams) -> Any: ...  # raises GrammarCompileError

    def matcher(self, compiled: Any) -> Matcher: ...

    def allocate_bitmask(self, rows: int) -> torch.Tensor: ...

    def batch_bitmask(self, rows: int) -> torch.Tensor: ...  # a reused buffer of `rows` rows, contents stale

    def fill_bitmasks(self, matchers: list[Any], bitmask: torch.Tensor, rows: list[int]) -> None: ...

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None: ...
