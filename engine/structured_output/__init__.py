"""Structured outputs: grammars compiled once per spec, one matcher per sequence, a batch bitmask per step."""

from llmctl.engine.structured_output.bitmask import apply_grammar_bitmask
from llmctl.engine.structured_output.manager import SequenceGrammar, StructuredOutputManager

__all__ = ["SequenceGrammar", "StructuredOutputManager", "apply_grammar_bitmask"]
