"""`StructuredOutputManager`: the engine's grammars. Compiles each distinct spec once (cached by
`StructuredOutputsParams.key`, least recently used dropped past `CACHE_SIZE`), and gives each sequence its own
`SequenceGrammar`: a matcher that has accepted exactly the sequence's output tokens at every step boundary.

Thread-safe: the server compiles on a worker thread before it submits a request (`compile`), so neither its
event loop nor the engine's step loop waits on a compile; the engine's `add_request` then finds it cached.
The backend loads on the first request that asks for a grammar (importing xgrammar takes seconds).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Optional

from llmctl.engine.errors import InvalidRequestError
from llmctl.engine.sampling_params import StructuredOutputsParams
from llmctl.engine.structured_output.backend import GrammarCompileError, Matcher, StructuredOutputBackend
from llmctl.engine.tokenizer import Tokenizer

CACHE_SIZE = 512  # compiled grammars kept (a JSON schema's for a 150k vocabulary: a few hundred KiB)


class SequenceGrammar:
    """One sequence's grammar state. `num_tokens`: the output tokens its matcher has accepted; `is_terminated`:
    it accepted a stop token at the grammar's end (kept here: the step loop asks for it per token)."""

    def __init__(self, matcher: Matcher, backend: StructuredOutputBackend):
        self.matcher = matcher
        self.backend = backend
        self.num_tokens = 0
        self.is_terminated = False

    def accept(self, token_ids: list[int]) -> int:
        """Advance through `token_ids`; returns how many it took (fewer: one was refused, or the grammar ended)."""
        for count, token in enumerate(token_ids):
            if self.is_terminated or not self.matcher.accept_token(token):
                return count
            self.num_tokens += 1
            self.is_terminated = self.matcher.is_terminated()
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_tokens -= num_tokens
            self.is_terminated = self.matcher.is_terminated()

    def at_boundary(self, output_token_ids: list[int]) -> bool:
        """Whether a row of these outputs is this matcher's next position (no drafts before it)."""
        return len(output_token_ids) == self.num_tokens

    def fill_rows(self, bitmask: Any, rows: list[tuple[int, list[int]]]) -> list[int]:
        """Fill the bitmask row of each (row, output_token_ids) of this sequence; returns the rows filled. A
        verify row's positions see the drafts before them (their outputs extend this sequence's by those
        drafts): the matcher is advanced through the drafts and rolled back after. A position past a draft the
        grammar refuses, or past its end, is left unfilled (its token is dropped with the refused draft)."""
        accepted, advanced, filled = self.num_tokens, 0, []
        try:
            for row, output in sorted(rows, key=lambda item: len(item[1])):
                pending = output[accepted:]
                while advanced < len(pending) and self.accept([pending[advanced]]) == 1:
                    advanced += 1
                if advanced == len(pending) and not self.is_terminated:
                    self.matcher.fill_bitmask(bitmask, row)
                    filled.append(row)
        finally:
            self.rollback(advanced)
        return filled


class StructuredOutputManager:
    def __init__(self, backend_name: str, tokenizer: Optional[Tokenizer], vocab_size: int,
                 stop_token_ids: frozenset[int]):
        """`backend_name`: --structured-outputs-backend (auto: xgrammar); `vocab_size`: the model's (its logits'
        width); `stop_token_ids`: the tokens that end an output where the grammar may end."""
        self.backend_name = "xgrammar" if backend_name == "auto" else backend_name
        self._backend_inputs = (tokenizer, vocab_size, stop_token_ids)
        self._backend: Optional[StructuredOutputBackend] = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.compile_seconds: list[float] = []  # each compile's wall time, in order (for the benchmark and tests)

    @property
    def backend(self) -> StructuredOutputBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def _make_backend(self) -> StructuredOutputBackend:
        tokenizer, vocab_size, stop_token_ids = self._backend_inputs
        if tokenizer is None:
            raise InvalidRequestError("structured_outputs need a tokenizer (the engine runs with skip_tokenizer_init)",
                                      param="structured_outputs")
        from llmctl.engine.structured_output.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(tokenizer, vocab_size, stop_token_ids)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The spec's compiled grammar: from the cache, or compiled now (a spec the backend refuses raises
        `InvalidRequestError` naming the construct)."""
        key = spec.key
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        backend = self.backend
        start = time.perf_counter()
        try:
            compiled = backend.compile(spec)
        except GrammarCompileError as exc:
            raise InvalidRequestError(str(exc), param="structured_outputs") from None
        with self._lock:
            self.compile_seconds.append(time.perf_counter() - start)
            self._compiled[key] = compiled
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def grammar_for(self, spec: StructuredOutputsParams) -> SequenceGrammar:
        """A fresh grammar state for one sequence."""
        compiled = self.compile(spec)
        backend = self.backend
        return SequenceGrammar(backend.matcher(compiled), backend)
