"""`ModelConfig`: the architecture facts read from a Hugging Face `config.json`.

Accepts both the classic keys (`rope_theta`, `rope_scaling`, `torch_dtype`) and transformers 5's
(`rope_parameters`, `dtype`). One flag set describes the whole Llama family we run.

A pre-quantised checkpoint says so in `quantization_config`: the quantisation registry
(engine/layers/quantization/) parses it by its `quant_method` into `ModelConfig.quantization`, refusing an
unknown method and the variants of a known one that the engine does not run, by name.
"""

from __future__ import annotations

import json
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.fused_moe.config import MOE_ARCHITECTURES, MoEConfig
from llmctl.engine.layers.rotary import SCALED_ROPE_TYPES
from llmctl.engine.layers.quantization import QuantizationConfig, QuantizationRegistry, active_registry

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                           *MOE_ARCHITECTURES)
GEMMA_ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# The decoder linears in Hugging Face's names, inside model.layers.N
DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: Optional[int]  # the window every layer slides over; None where none do or layers mix
    hidden_act: str
    checkpoint_dtype: Optional[str]
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Gemma: RMSNorm scales by (offset + weight), embeddings are multiplied by sqrt(hidden_size) in the model dtype
    norm_weight_offset: float = 0.0
    embedding_multiplier: Optional[float] = None
    # config.json's quantization_config.quant_method (a pre-quantised checkpoint), a GGUF file's types, else None
    quant_method: Optional[str] = None
    quantization: Optional[QuantizationConfig] = None  # its quantization_config, parsed by the registry
    moe: Optional[MoEConfig] = None  # a mixture-of-experts architecture's routing facts, else None
    # Where sliding and full-attention layers mix (Gemma 2/3, Qwen2's max_window_layers): each layer's window
    # (None: full attention); empty where every layer has `sliding_window`.
    layer_windows: tuple[Optional[int], ...] = ()
    attention_scale: Optional[float] = None  # Gemma 2/3: query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    attn_logit_softcapping: Optional[float] = None  # Gemma 2: scores become cap * tanh(scores / cap)
    final_logit_softcapping: Optional[float] = None  # Gemma 2: the same on the logits
    local_rope_theta: Optional[float] = None  # Gemma 3: the sliding layers' RoPE base (unscaled); None: the global

    def window_of(self, layer: int) -> Optional[int]:
        """Layer `layer`'s sliding window, None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @classmethod
    def from_pretrained(cls, folder: Path, registry: Optional[QuantizationRegistry] = None) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"no config.json in {folder}")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path} must hold a JSON object")
        return cls.from_dict(raw, source=str(path), registry=registry)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json",
                  registry: Optional[QuantizationRegistry] = None) -> "ModelConfig":
        """`registry`: the quantisation formats a quantization_config may name (default: the active one)."""
        architecture = _architecture(raw, source)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            base = dict(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source} lacks required key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source} has a non-integer size field: {exc}") from None
        rope_theta, rope_scaling, local_rope_theta = _rope(raw)
        partial = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        if partial is not None and float(partial) != 1.0:
            raise ModelLoadError(f"{source}: partial_rotary_factor {partial} is not supported (RoPE over whole heads)")
        is_qwen2 = architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        is_gemma = architecture in GEMMA_ARCHITECTURES
        sliding_window, layer_windows = _sliding_windows(raw, architecture, source)
        scalar = raw.get("query_pre_attn_scalar") if architecture != "GemmaForCausalLM" else None
        config = cls(
            architecture=architecture,
            **base,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", is_gemma)),
            qkv_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
            o_bias=(not is_qwen2) and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=sliding_window,
            layer_windows=layer_windows,
            attention_scale=float(scalar) ** -0.5 if scalar else None,
            attn_logit_softcapping=_positive(raw.get("attn_logit_softcapping")),
            final_logit_softcapping=_positive(raw.get("final_logit_softcapping")),
            local_rope_theta=10000.0 if local_rope_theta is None and architecture == "Gemma3ForCausalLM"
            else local_rope_theta,
            hidden_act=_activation(raw, is_gemma),
            checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=_int_tuple(raw.get("eos_token_id")),
            quant_method=_quant_method(raw),
            norm_weight_offset=1.0 if is_gemma else 0.0,
            embedding_multiplier=hidden ** 0.5 if is_gemma else None,
            moe=MoEConfig.from_dict(raw, architecture, base["num_layers"], source),
        )
        config._validate(source)
        if config.quant_method is not None and config.moe is not None:
            raise ModelLoadError(f"{source}: pre-quantised ({config.quant_method}) mixture-of-experts checkpoints "
                                 f"are not supported ({architecture})")
        if config.quant_method is not None and architecture == "Phi3ForCausalLM":
            raise ModelLoadError(f"{source}: pre-quantised ({config.quant_method}) {architecture} checkpoints are "
                                 "not supported (their fused qkv_proj / gate_up_proj)")
        if config.quant_method is not None:
            linear_names = [f"model.layers.{i}.{name}" for i in range(config.num_layers) for name in DECODER_LINEARS]
            parsed = (registry or active_registry()).checkpoint_config(
                config.quant_method, raw["quantization_config"], source, linear_names)
            config = dataclasses.replace(config, quantization=parsed)
        return config

    @property
    def max_context(self) -> int:
        """The longest context the model runs: max_position_embeddings, stretched by a YaRN or dynamic-NTK factor
        (YaRN's from its original length), as vLLM derives it."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") in ("yarn", "dynamic"):
            stretched = int(scaling["original_max_position_embeddings"] * float(scaling["factor"]))
            return max(self.max_position_embeddings, stretched)
        return self.max_position_embeddings

    def _validate(self, source: str) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads {self.num_heads} is not a multiple of "
                                 f"num_key_value_heads {self.num_kv_heads}")
        if self.hidden_act not in ("silu", "swish", "gelu_pytorch_tanh"):
            raise ModelLoadError(f"{source}: hidden_act {self.hidden_act!r} is not supported "
                                 "(silu, gelu_pytorch_tanh)")
        self._validate_rope(source)

    def _validate_rope(self, source: str) -> None:
        scaling = self.rope_scaling or {}
        rope_type = scaling.get("rope_type", "default")
        if rope_type not in ("default",) + SCALED_ROPE_TYPES:
            raise ModelLoadError(f"{source}: rope_scaling type {rope_type!r} is not supported "
                                 f"(supported: default, {', '.join(SCALED_ROPE_TYPES[:-1])})")
        for key in ("short_factor", "long_factor") if rope_type == "longrope" else ():
            if len(scaling.get(key) or ()) != self.head_dim // 2:
                raise ModelLoadError(f"{source}: rope_scaling {key} needs head_dim / 2 = {self.head_dim // 2} "
                                     "entries")


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    if "Gemma3ForConditionalGeneration" in archs:
        raise ModelLoadError(f"{source}: Gemma3ForConditionalGeneration is a vision-language checkpoint (a vision "
                             "tower and its projector) and vision models are not supported; text-only Gemma 3 "
                             "checkpoints (Gemma3ForCausalLM) are")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention (an embedding model) is not supported")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    named = ", ".join(archs) if archs else f"model_type {raw.get('model_type')!r}"
    raise ModelLoadError(f"{source}: unsupported architecture {named}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _activation(raw: dict[str, Any], is_gemma: bool) -> str:
    """The MLP's gate activation; Gemma's legacy "gelu" (and hidden_activation) mean the tanh approximation, as
    transformers reads them."""
    if not is_gemma:
        return str(raw.get("hidden_act", "silu"))
    act = str(raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh")
    return "gelu_pytorch_tanh" if act == "gelu" else act


def _quant_method(raw: dict[str, Any]) -> Optional[str]:
    """The checkpoint's quantisation method: quantization_config.quant_method (GPTQ, AWQ,
    compressed-tensors, fp8, bitsandbytes, ...); "unnamed" for a quantization_config without one."""
    config = raw.get("quantization_config")
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else None
    return str(method) if method else "unnamed"


def _rope(raw: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]], Optional[float]]:
    """(theta, scaling) of the global RoPE, and the sliding layers' own base where the model has one (Gemma 3:
    rope_parameters per layer type, or the classic rope_local_base_freq)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        local = (params.get("sliding_attention") or {}).get("rope_theta", raw.get("rope_local_base_freq"))
        theta, scaling = _global_rope(raw, params["full_attention"])
        return theta, scaling, None if local is None else float(local)
    local = raw.get("rope_local_base_freq")
    return (*_global_rope(raw, params), None if local is None else float(local))


def _global_rope(raw: dict[str, Any], params: Any) -> tuple[float, Optional[dict[str, Any]]]:
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type") == "su":  # early Phi-3 configs' name for LongRoPE
        scaling["rope_type"] = "longrope"
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return theta, None
    return theta, _rope_lengths(scaling, raw)


def _rope_lengths(scaling: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """The pretraining length the scaling is relative to, where transformers reads it: for llama3, YaRN and
    LongRoPE the config's top-level original_max_position_embeddings first (Phi-3 keeps it there), then the
    scaling's own, then max_position_embeddings; for dynamic NTK, max_position_embeddings. A missing YaRN or
    LongRoPE factor is the ratio of the two lengths."""
    rope_type, longest = scaling["rope_type"], int(raw.get("max_position_embeddings", 2048))
    if rope_type == "dynamic":
        return scaling | {"original_max_position_embeddings": longest}
    if rope_type not in ("llama3", "yarn", "longrope"):
        return scaling
    original = int(raw.get("original_max_position_embeddings")
                   or scaling.get("original_max_position_embeddings") or longest)
    scaling = scaling | {"original_max_position_embeddings": original}
    if rope_type in ("yarn", "longrope") and scaling.get("factor") is None:
        scaling["factor"] = longest / original
    return scaling


def _sliding_windows(raw: dict[str, Any], architecture: str,
                     source: str) -> tuple[Optional[int], tuple[Optional[int], ...]]:
    """(the window every layer slides over, or None; each layer's window where sliding and full layers mix).
    Qwen models slide only with use_sliding_window; an explicit layer_types says per layer, else
    `_default_layer_types` (transformers' rules)."""
    window = raw.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return None, ()
    if architecture.startswith(("Qwen2", "Qwen3")) and not raw.get("use_sliding_window", False):
        return None, ()
    layers = int(raw["num_hidden_layers"])
    layer_types = list(raw.get("layer_types") or _default_layer_types(raw, architecture, layers))
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown or len(layer_types) != layers:
        raise ModelLoadError(f"{source}: layer_types must name sliding_attention or full_attention for each of the "
                             f"{layers} layers (got {', '.join(sorted(map(str, unknown))) or len(layer_types)})")
    windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if len(set(windows)) == 1:
        return windows[0], ()
    return None, windows


def _default_layer_types(raw: dict[str, Any], architecture: str, layers: int) -> list[str]:
    """Qwen2/3: layers from max_window_layers on slide (Qwen2-MoE: the even ones below it); Gemma 2 alternates
    sliding and full from layer 0; Gemma 3 makes every sliding_window_pattern-th layer full; else all slide."""
    if architecture.startswith(("Qwen2", "Qwen3")):
        first = int(raw.get("max_window_layers", 28))
        if architecture == "Qwen2MoeForCausalLM":
            return ["sliding_attention" if (i + 1) % 2 and i < first else "full_attention" for i in range(layers)]
        return ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        pattern = 2 if architecture == "Gemma2ForCausalLM" else int(raw.get("sliding_window_pattern", 6))
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return ["sliding_attention"] * layers


def _positive(value: Any) -> Optional[float]:
    """A soft-cap as transformers reads it: None or 0 means none."""
    return float(value) if value else None


def _int_tuple(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(v for v in value if isinstance(v, int))
    return ()
