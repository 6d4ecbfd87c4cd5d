"""llmctl: one command-line toolkit for LLM inference hosts."""

from llmctl.__about__ import __version__

__all__ = ["__version__"]
