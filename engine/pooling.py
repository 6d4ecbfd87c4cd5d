"""Pooling requests (vLLM's embeddings): a prefill with no decode whose final-norm hidden states come back
pooled into one vector per prompt.

Each step the runner sums, per pooling row, the float32 hidden states its pooling type reads in that chunk
(MEAN: every prompt token; LAST: the prompt's last; CLS: its first); the scheduler adds each sum into the
sequence's `Pooling`, so a chunked prefill pools exactly like a whole one. `Pooling.embedding` then divides
(MEAN), truncates to `dimensions` (Matryoshka) and L2-normalises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch

from llmctl.engine.errors import InvalidRequestError, ModelLoadError
from llmctl.engine.sampling_params import RequestOutputKind

# sentence-transformers' 1_Pooling/config.json mode -> vLLM's pooling type
SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                               "pooling_mode_cls_token": "CLS"}
ST_POOLING, ST_NORMALIZE = "sentence_transformers.models.Pooling", "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's `PoolingParams` for embeddings: `dimensions` truncates a Matryoshka model's vector; `normalize`
    (None: the model's default) L2-normalises it."""

    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    output_kind: ClassVar[RequestOutputKind] = RequestOutputKind.FINAL_ONLY  # one output, when pooled

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError("dimensions must be an integer >= 1", param="dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError("normalize must be true or false", param="normalize")


@dataclass(frozen=True)
class PoolerConfig:
    """How this checkpoint pools: its sentence-transformers modules when it has them, else vLLM's defaults for a
    decoder (LAST, normalised); `pooling_type` overrides the type (--pooling-type)."""

    pooling_type: str
    normalize: bool
    hidden_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: Optional[tuple[int, ...]] = None
    # the checkpoint's sentence-transformers pooling when the engine does not run it (max, weighted mean, ...):
    # pooling requests are refused naming it, generation is unaffected
    unsupported: Optional[str] = None

    @classmethod
    def from_checkpoint(cls, folder: Path, hidden_size: int, override: str = "auto") -> "PoolerConfig":
        """From the model folder (a GGUF file has neither sentence-transformers modules nor Matryoshka keys)."""
        pooling_type, normalize, unsupported = "LAST", True, None
        modules = _read_json(folder / "modules.json") if folder.is_dir() else None
        raw_config = (_read_json(folder / "config.json") if folder.is_dir() else None) or {}
        if isinstance(modules, list):
            normalize = any(isinstance(m, dict) and m.get("type") == ST_NORMALIZE for m in modules)
            pooling = next((m for m in modules if isinstance(m, dict) and m.get("type") == ST_POOLING), None)
            settings = (_read_json(folder / str(pooling.get("path", "")) / "config.json") if pooling else None) or {}
            modes = [key for key, on in settings.items() if key.startswith("pooling_mode_") and on is True]
            if len(modes) == 1 and modes[0] in SENTENCE_TRANSFORMERS_MODES:
                pooling_type = SENTENCE_TRANSFORMERS_MODES[modes[0]]
            elif modes:
                unsupported = " + ".join(modes)
        dims = raw_config.get("matryoshka_dimensions")
        dims = tuple(dims) if isinstance(dims, list) and dims else None
        if override != "auto":
            pooling_type, unsupported = override, None
        return cls(pooling_type, normalize, hidden_size, bool(raw_config.get("is_matryoshka")) or bool(dims), dims,
                   unsupported)

    def check(self, params: PoolingParams) -> None:
        """Refuse what this model cannot pool as asked (a 400 naming the field)."""
        if self.unsupported is not None:
            raise InvalidRequestError(f"this checkpoint pools with sentence-transformers {self.unsupported}, which the "
                                      "engine does not run (LAST, MEAN or CLS: choose one with --pooling-type)")
        if params.dimensions is None:
            return
        if not self.is_matryoshka:
            raise InvalidRequestError("dimensions: this model does not declare Matryoshka support "
                                      "(is_matryoshka / matryoshka_dimensions in its config.json)", param="dimensions")
        allowed = self.matryoshka_dimensions
        if params.dimensions > self.hidden_size or (allowed and params.dimensions not in allowed):
            supported = list(allowed) if allowed else f"1..{self.hidden_size}"
            raise InvalidRequestError(f"dimensions {params.dimensions} is not supported by this model "
                                      f"(supported: {supported})", param="dimensions")


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None


@dataclass
class Pooling:
    """A pooling sequence's request and the sum of the hidden states pooled so far (reset on preemption)."""

    params: PoolingParams
    pooling_type: str
    normalize: bool  # resolved: the request's, else the model's default
    hidden_sum: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def reads_prefix(self) -> bool:
        """Reads hidden states before the last token, so a cached prefix (no hidden states) will not do."""
        return self.pooling_type != "LAST"

    def positions(self, start: int, end: int, num_prompt_tokens: int) -> range:
        """Which of the chunk's positions [start, end) this pooling reads."""
        if self.pooling_type == "MEAN":
            return range(start, end)
        wanted = num_prompt_tokens - 1 if self.pooling_type == "LAST" else 0
        return range(wanted, wanted + 1) if start <= wanted < end else range(0)

    def add(self, chunk_sum: Optional[torch.Tensor]) -> None:
        if chunk_sum is not None:
            self.hidden_sum = chunk_sum if self.hidden_sum is None else self.hidden_sum + chunk_sum

    def reset(self) -> None:
        self.hidden_sum = None

    def embedding(self, num_prompt_tokens: int) -> torch.Tensor:
        """The pooled float32 vector: the mean for MEAN, truncated to `dimensions`, then L2-normalised if asked."""
        pooled = self.hidden_sum / num_prompt_tokens if self.pooling_type == "MEAN" else self.hidden_sum
        if self.params.dimensions is not None:
            pooled = pooled[: self.params.dimensions]
        return torch.nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled
