"""What a quantisation format gives the registry (engine/layers/quantization/__init__.py): a config class.

`QuantizationConfig` (vLLM's name): `from_quantization_config` validates what names the format (a checkpoint's
`quantization_config`, `{"quant_method": value}` for a `--quantization` value, `{"quant_method": "gguf"}` for a
.gguf file) and refuses the variants the engine does not run by name; `linear_methods` makes the methods of the
decoder linears and of the lm_head for a `LinearTarget`; `describe` is the scheme as logs and reports name it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

import torch

from llmctl.engine.errors import EngineArgsError
from llmctl.engine.layers.linear import LinearMethod, select_linear_method


@dataclass(frozen=True)
class LinearTarget:
    """What the linear methods are made for: the activations' device and dtype, the native CPU kernels (or
    None), the rows the unquantised method is tuned for, the load format ("dummy": random weights) and whether
    the lm_head shares the embedding's weight."""

    device: torch.device
    dtype: torch.dtype
    kernels: Any = None
    batch_hint: int = 1
    load_format: str = "auto"
    tie_word_embeddings: bool = False

    def unquantized(self) -> LinearMethod:
        """The fastest full-precision method here (for linears a format leaves unquantised)."""
        return select_linear_method(self.device, self.dtype, self.kernels, batch_hint=self.batch_hint)


class LinearMethods(NamedTuple):
    """The decoder linears' method and the lm_head's own (None: the lm_head runs `linear` too)."""

    linear: LinearMethod
    lm_head: Optional[LinearMethod] = None


class QuantizationConfig(ABC):
    """One format's validated settings; subclasses are usually frozen dataclasses."""

    @classmethod
    @abstractmethod
    def from_quantization_config(cls, raw: dict[str, Any], source: str,
                                 linear_names: Sequence[str]) -> "QuantizationConfig":
        """`raw` validated (`source` names where it came from; `linear_names`: the decoder linears' full names),
        anything the engine would not run as written refused with a one-line error naming it."""

    @abstractmethod
    def linear_methods(self, target: LinearTarget) -> LinearMethods:
        """The methods that load and run this format's linears on `target`."""

    @abstractmethod
    def describe(self) -> str:
        """The scheme in a few words ("gptq 4-bit group 128, sym (gptq)")."""


def check_float_dtype(flag_value: str, dtype: torch.dtype) -> None:
    """A `--quantization` method quantises full-precision weights: the model dtype must be a float one."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise EngineArgsError(f"--quantization {flag_value} needs a float dtype, got {dtype}")
