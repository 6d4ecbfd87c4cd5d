"""Weight quantisation: one registry from a format's name to its config class, and the runner's one call.

As vLLM's `get_quantization_config`: a name -> the format's `QuantizationConfig` class (base.py), which validates
what named it and makes the linear methods. A name is chosen by one of three things (`QuantizationFormat.chosen_by`):
config.json's `quantization_config.quant_method` (a pre-quantised checkpoint), a `--quantization` value (a
full-precision checkpoint quantised on load), or the checkpoint's file type (a .gguf file). `ModelConfig` asks the
registry to parse a checkpoint's quantization_config (an unknown quant_method is refused naming it), and
`linear_methods_for` is the runner's one call for the linears' methods.

A new format is one module (its config class and linear method) plus one `QuantizationFormat` line in
`BUILT_IN_FORMATS`; tests extend a registry with `with_formats` and make it the active one with `activated()`.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch

from llmctl.engine.args import CHECKPOINT_QUANTIZATIONS
from llmctl.engine.errors import EngineArgsError, ModelLoadError
from llmctl.engine.layers.linear import LinearMethod
from llmctl.engine.layers.quantization.awq import AWQConfig
from llmctl.engine.layers.quantization.base import LinearMethods, LinearTarget, QuantizationConfig
from llmctl.engine.layers.quantization.compressed_tensors import CompressedTensorsConfig
from llmctl.engine.layers.quantization.fp8 import Fp8Config
from llmctl.engine.layers.quantization.gguf import GGUFConfig
from llmctl.engine.layers.quantization.gptq import GPTQConfig
from llmctl.engine.layers.quantization.on_the_fly import ON_THE_FLY_SCHEMES, OnTheFlyIntConfig

if TYPE_CHECKING:  # model_config imports this package
    from llmctl.engine.model_config import ModelConfig

# What chooses a format (`QuantizationFormat.chosen_by`)
CHECKPOINT, FLAG, FILE = "quant_method", "--quantization", "file"


@dataclass(frozen=True)
class QuantizationFormat:
    """One registered format: its name where `chosen_by` names it, and the config class that parses it."""

    name: str
    config_class: type[QuantizationConfig]
    chosen_by: str = CHECKPOINT

    def __post_init__(self) -> None:
        if self.chosen_by not in (CHECKPOINT, FLAG, FILE):
            raise ValueError(f"quantization format {self.name!r}: chosen_by must be one of {CHECKPOINT!r}, "
                             f"{FLAG!r}, {FILE!r}, got {self.chosen_by!r}")


@dataclass(frozen=True)
class QuantizationRegistry:
    """The formats the engine loads, at most one per (chosen_by, name); a value, extended into a new one."""

    formats: tuple[QuantizationFormat, ...]

    def __post_init__(self) -> None:
        keys = [(f.chosen_by, f.name) for f in self.formats]
        repeated = sorted({f"{name} ({chosen_by})" for chosen_by, name in keys if keys.count((chosen_by, name)) > 1})
        if repeated:
            raise ValueError(f"quantization formats registered twice: {', '.join(repeated)}")

    def with_formats(self, *formats: QuantizationFormat) -> "QuantizationRegistry":
        """A new registry of these formats and `formats` (this one is unchanged)."""
        return QuantizationRegistry((*self.formats, *formats))

    def names(self, chosen_by: str = CHECKPOINT) -> tuple[str, ...]:
        return tuple(f.name for f in self.formats if f.chosen_by == chosen_by)

    def get_quantization_config(self, name: str, chosen_by: str = CHECKPOINT) -> Optional[type[QuantizationConfig]]:
        """The config class registered for `name` (None: none is)."""
        return next((f.config_class for f in self.formats if (f.chosen_by, f.name) == (chosen_by, name)), None)

    def checkpoint_config(self, quant_method: str, raw: dict[str, Any], source: str,
                          linear_names: Sequence[str]) -> QuantizationConfig:
        """config.json's quantization_config parsed by its quant_method's class; an unknown one is refused,
        since loading its packed tensors as if full precision would run garbage weights."""
        config_class = self.get_quantization_config(quant_method)
        if config_class is None:
            raise ModelLoadError(f"{source}: quantization_config.quant_method {quant_method!r} is not supported "
                                 f"(pre-quantised checkpoints: {', '.join(self.names())}; or load the "
                                 f"full-precision checkpoint with --quantization ({', '.join(self.names(FLAG))}) "
                                 "to quantise it on the fly)")
        return config_class.from_quantization_config(raw, source, linear_names)

    def flag_config(self, value: str) -> QuantizationConfig:
        """The config of a `--quantization` value."""
        config_class = self.get_quantization_config(value, FLAG)
        if config_class is None:
            raise EngineArgsError(f"quantization {value!r} is not supported (supported: {', '.join(self.names(FLAG))})")
        return config_class.from_quantization_config({"quant_method": value}, FLAG, ())

    def file_config(self, kind: str, source: str) -> QuantizationConfig:
        """The config of a checkpoint file that is quantised by its type ("gguf")."""
        config_class = self.get_quantization_config(kind, FILE)
        if config_class is None:
            raise ModelLoadError(f"{source}: {kind} checkpoints are not supported")
        return config_class.from_quantization_config({"quant_method": kind}, source, ())

    @contextmanager
    def activated(self) -> Iterator["QuantizationRegistry"]:
        """Within the block (this thread or task), `active_registry()` is this one; the previous one after."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


BUILT_IN_FORMATS = (
    *(QuantizationFormat(name, OnTheFlyIntConfig, FLAG) for name in ON_THE_FLY_SCHEMES),
    QuantizationFormat("fp8", Fp8Config, FLAG),
    QuantizationFormat("compressed-tensors", CompressedTensorsConfig),
    QuantizationFormat("gptq", GPTQConfig),
    QuantizationFormat("awq", AWQConfig),
    QuantizationFormat("gguf", GGUFConfig, FILE),
)
DEFAULT_REGISTRY = QuantizationRegistry(BUILT_IN_FORMATS)
_ACTIVE: ContextVar[QuantizationRegistry] = ContextVar("quantization_registry", default=DEFAULT_REGISTRY)


def active_registry() -> QuantizationRegistry:
    """The registry in effect: DEFAULT_REGISTRY unless a block runs under another's `activated()`."""
    return _ACTIVE.get()


def on_the_fly_quantization(quantization: Optional[str], model_config: "ModelConfig") -> Optional[str]:
    """The `--quantization` value left to apply on load: None where it names the checkpoint's own format
    (gptq, awq, compressed-tensors, as vLLM accepts them); such a name for any other checkpoint is refused."""
    if quantization not in CHECKPOINT_QUANTIZATIONS:
        return quantization
    if model_config.quant_method == quantization:
        return None
    found = f"quantised with {model_config.quant_method}" if model_config.quant_method else "not pre-quantised"
    raise EngineArgsError(f"--quantization {quantization} names a pre-quantised format, but the checkpoint is {found}")


def linear_methods_for(model_config: "ModelConfig", quantization: Optional[str], device: torch.device,
                       dtype: torch.dtype, kernels=None, *, gguf: bool = False, load_format: str = "auto",
                       batch_hint: int = 1, registry: Optional[QuantizationRegistry] = None) -> LinearMethods:
    """The linears' methods for a model (`ModelConfig`; `gguf`: its weights come from a .gguf file): the
    `--quantization` method, the checkpoint's own format, or the fastest unquantised method. `batch_hint`: the
    rows the unquantised method is tuned for."""
    registry = registry or active_registry()
    quantization = on_the_fly_quantization(quantization, model_config)
    target = LinearTarget(device, dtype, kernels, batch_hint, load_format, model_config.tie_word_embeddings)
    if (model_config.quant_method is not None or gguf) and quantization:
        named = "GGUF" if gguf else model_config.quant_method
        raise EngineArgsError(f"the checkpoint is already quantised ({named}); drop --quantization {quantization}")
    if quantization and model_config.moe is not None and quantization not in ON_THE_FLY_SCHEMES:
        raise EngineArgsError(f"--quantization {quantization} is not supported for mixture-of-experts models "
                              f"({model_config.architecture}; supported: {', '.join(ON_THE_FLY_SCHEMES)})")
    if quantization:
        config = registry.flag_config(quantization)
    elif gguf:
        config = registry.file_config("gguf", "GGUF")
    else:
        config = model_config.quantization
    return config.linear_methods(target) if config is not None else LinearMethods(target.unquantized())


def quantized_linear_method(quantization: str, device: torch.device, dtype: torch.dtype) -> LinearMethod:
    """The decoder linears' method for a `--quantization` value (benchmarks and tests of single layers)."""
    return active_registry().flag_config(quantization).linear_methods(LinearTarget(device, dtype)).linear


__all__ = ["CHECKPOINT", "DEFAULT_REGISTRY", "FILE", "FLAG", "LinearMethods", "LinearTarget", "QuantizationConfig",
           "QuantizationFormat", "QuantizationRegistry", "active_registry", "linear_methods_for",
           "on_the_fly_quantization", "quantized_linear_method"]
