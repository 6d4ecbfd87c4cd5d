"""The xgrammar backend (vLLM's and SGLang's default): JSON schema, regex, choice, EBNF and any-JSON grammars
compiled against the engine's tokenizer, one `GrammarMatcher` per sequence, bitmasks applied on CPU or CUDA.

The vocabulary comes from our tokenizer (engine/tokenizer.py) rather than a transformers tokenizer: its entries by
id and tokenizer.json's encoding (byte-level, byte-fallback or raw). `vocab_size` is the model's, so ids the
model has past the tokenizer's vocabulary (padding rows of the embedding) are never allowed.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from llmctl.engine.sampling_params import StructuredOutputsParams
from llmctl.engine.structured_output.backend import GrammarCompileError
from llmctl.engine.tokenizer import Tokenizer

# xgrammar's C++ errors start "[03:14:53] /project/cpp/regex_converter.cc:94: ": the time and source line
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
# xgrammar 0.2.9 spells a string with minLength/maxLength as characters of this class, which admits the raw
# control characters JSON forbids in a string (its unbounded strings exclude them): replaced by the class below.
_BOUNDED_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'
# what a refused spec is called in the error
_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}
# The JSON a json_object request must produce: any object (vLLM's json_object).
_ANY_OBJECT_SCHEMA = {"type": "object"}


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without its log prefix, on one line."""
    text = " ".join(str(exc).split("\n")).strip()
    return _XGRAMMAR_LOCATION.sub("", text) or type(exc).__name__


class XgrammarMatcher:
    def __init__(self, matcher: Any):
        self._matcher = matcher

    @property
    def xgrammar_matcher(self) -> Any:
        """The wrapped `xgrammar.GrammarMatcher` (what xgrammar's batch calls take)."""
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: frozenset[int], max_threads: int = 8):
        import xgrammar

        self._xgr = xgrammar
        # the detection TokenizerInfo.from_huggingface runs on a transformers tokenizer's tokenizer.json
        metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend_json())
        self.vocab_size = vocab_size
        self.tokenizer_info = xgrammar.TokenizerInfo(
            tokenizer.vocabulary(), metadata["vocab_type"], vocab_size=vocab_size,
            stop_token_ids=sorted(stop_token_ids), add_prefix_space=metadata["add_prefix_space"])
        # cache_enabled=False: the manager caches by spec (one compile per distinct spec, bounded)
        self.compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        # "auto": half the host's hardware threads fill a batch's rows (the step loop waits on it, the model does not run)
        self._batch_matcher = xgrammar.BatchGrammarMatcher("auto")
        self._bitmask = self.allocate_bitmask(0)  # the step's bitmask, grown to the largest batch and reused

    def compile(self, spec: StructuredOutputsParams) -> Any:
        kind, value = spec.kind, getattr(spec, spec.kind)
        try:
            if kind in ("json", "json_object"):
                schema = _ANY_OBJECT_SCHEMA if kind == "json_object" else value
                return self.compiler.compile_grammar(self._json_grammar(schema))
            if kind == "regex":
                return self.compiler.compile_regex(value)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(value))
            return self.compiler.compile_grammar(value)
        except Exception as exc:  # noqa: BLE001 - whatever a client's spec makes the compiler raise is a refusal
            raise GrammarCompileError(f"the {_KIND_NAMES[kind]} is not supported: {clean_error(exc)}") from None

    def _json_grammar(self, schema: Any) -> Any:
        """The schema's grammar: compact JSON (no free whitespace, so a model cannot pad the output with endless
        blanks), its bounded strings free of control characters."""
        schema_text = schema if isinstance(schema, str) else json.dumps(schema)
        grammar = self._xgr.Grammar.from_json_schema(schema_text, any_whitespace=False)
        text = str(grammar)
        if _BOUNDED_STRING_CHARACTER not in text:
            return grammar
        return text.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)

    def matcher(self, compiled: Any) -> XgrammarMatcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def batch_bitmask(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of the reused bitmask (contents stale: fill a row before applying it)."""
        if self._bitmask.shape[0] < rows:
            self._bitmask = self.allocate_bitmask(rows)
        return self._bitmask[:rows]

    def fill_bitmasks(self, matchers: list[XgrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill `bitmask[rows[i]]` from `matchers[i]`, all in one call."""
        self._batch_matcher.batch_fill_next_token_bitmask([m.xgrammar_matcher for m in matchers], bitmask, rows)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                              vocab_size=self.vocab_size, indices=rows)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (each a JSON-escaped string literal)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
