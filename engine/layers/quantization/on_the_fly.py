"""`--quantization int8 / int4[-gN][-asym]`: a full-precision checkpoint's linears quantised round-to-nearest on load.

`int8` is symmetric per output channel; `int4[-g32|-g64|-g128]` symmetric per group (`int4` is group 128,
llama.cpp's Q4_0 convention); `int4-asym`, `int4-g32-asym`, ... keep a zero point per group (min/max range,
llama.cpp's Q4_1 / GPTQ sym=False / AWQ convention). Scales are rounded to float16 (what GPTQ, AWQ and GGUF
store) and the codes are rounded against the rounded scale, so dequantising the `GroupedIntWeight` is the exact
reference of what the layer holds. The lm_head is quantised too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from llmctl.engine.errors import EngineArgsError, ModelLoadError
from llmctl.engine.layers.linear import LinearBase, UnquantizedLinearMethod
from llmctl.engine.layers.quantization.base import (LinearMethods, LinearTarget, QuantizationConfig,
                                                    check_float_dtype)
from llmctl.engine.layers.quantization.grouped import (GroupedIntLinearMethod, GroupedIntWeight,
                                                       install_grouped_weight)

logger = logging.getLogger(__name__)

class OnTheFlyIntLinearMethod(GroupedIntLinearMethod, UnquantizedLinearMethod):
    """Loads like an unquantised linear (same shards, loaders and tied embeddings), then quantises the
    full-precision weight round-to-nearest and installs it."""

    def __init__(self, bits: int, group_size: Optional[int], symmetric: bool):
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric  # group None: per output row

    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype) -> None:
        if self.group_size is not None and layer.in_features % self.group_size:
            raise ModelLoadError(f"int{self.bits} group size {self.group_size} does not divide a linear's "
                                 f"{layer.in_features} inputs; choose a smaller group (int4-g32, int4-g64)")
        super().create_weights(layer, bias, dtype)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        full = layer.weight.data
        weight = GroupedIntWeight.quantize(full, self.bits, self.group_size or layer.in_features, self.symmetric)
        install_grouped_weight(layer, weight, full.dtype)


def _on_the_fly_schemes() -> dict[str, tuple[int, Optional[int], bool]]:
    schemes: dict[str, tuple[int, Optional[int], bool]] = {"int8": (8, None, True)}
    for suffix, group in (("", 128), ("-g32", 32), ("-g64", 64), ("-g128", 128)):
        schemes[f"int4{suffix}"] = (4, group, True)
        schemes[f"int4{suffix}-asym"] = (4, group, False)
    return schemes


# name -> (bits, group size or None for per output channel, symmetric); EngineArgs' ON_THE_FLY_QUANTIZATIONS
ON_THE_FLY_SCHEMES = _on_the_fly_schemes()


@dataclass(frozen=True)
class OnTheFlyIntConfig(QuantizationConfig):
    """One of ON_THE_FLY_SCHEMES, by its `--quantization` name."""

    name: str
    bits: int
    group_size: Optional[int]  # None: one group per output channel
    symmetric: bool

    @classmethod
    def from_quantization_config(cls, raw: dict[str, Any], source: str,
                                 linear_names: Sequence[str]) -> "OnTheFlyIntConfig":
        name = raw.get("quant_method")
        if name not in ON_THE_FLY_SCHEMES:
            raise EngineArgsError(f"quantization {name!r} is not supported (supported: "
                                  f"{', '.join(ON_THE_FLY_SCHEMES)})")
        return cls(name, *ON_THE_FLY_SCHEMES[name])

    def linear_methods(self, target: LinearTarget) -> LinearMethods:
        check_float_dtype(self.name, target.dtype)
        if target.device.type == "cpu" and target.dtype is torch.float32:
            logger.warning("quantised weights with float32 activations run about 5x slower than with bfloat16 "
                           "(--dtype bfloat16)")
        logger.info("linear layers: %s (%s, %s activations on %s)", self.name, f"{self.bits}-bit", target.dtype,
                    target.device)
        return LinearMethods(OnTheFlyIntLinearMethod(self.bits, self.group_size, self.symmetric))

    def describe(self) -> str:
        return self.name
