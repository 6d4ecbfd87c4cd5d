"""The llmctl inference engine: `from llmctl.engine import LLM, SamplingParams`.

Names are resolved lazily so that importing `llmctl.engine.errors` (or the CLI) does not pay for
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "llmctl.engine.llm",
    "LLMEngine": "llmctl.engine.llm_engine",
    "AsyncLLMEngine": "llmctl.engine.async_engine",
    "EngineArgs": "llmctl.engine.args",
    "SamplingParams": "llmctl.engine.sampling_params",
    "RequestOutputKind": "llmctl.engine.sampling_params",
    "RequestOutput": "llmctl.engine.outputs",
    "CompletionOutput": "llmctl.engine.outputs",
    "PoolingParams": "llmctl.engine.pooling",
    "PoolingRequestOutput": "llmctl.engine.outputs",
    "ModelLoadError": "llmctl.engine.errors",
    "EngineArgsError": "llmctl.engine.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llmctl.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
