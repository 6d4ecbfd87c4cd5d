"""GGUF files (`--model file.gguf`, llama.cpp's format) read with the `gguf` package.

`GGUFFile` gives what a Hugging Face folder would: the architecture and hyperparameters from the metadata
(as a config.json-shaped dict for `ModelConfig.from_dict`), the tokenizer fields (engine/tokenizer.py builds
the tokenizer from them) and the tensors under Hugging Face names. Linear weights are yielded raw (ggml
blocks, `<name>.qweight` + `<name>.qweight_type`) for `GGUFLinearMethod`; every other tensor (embeddings,
norms, biases) dequantised to float32. A tied file's token_embd in a grouped type is also yielded raw as the
lm_head's (`GGUFFile.head_from_embedding`), so the output matrix runs on the file's own codes.

llama.cpp's converter permutes the rows of a Llama q/k projection so that RoPE rotates adjacent pairs
(convert_hf_to_gguf.py `LlamaModel.permute`); the engine's RoPE rotates halves, as Hugging Face does, so
those rows are permuted back here (whole rows of blocks, so quantised tensors too). Qwen2/Qwen3 files are
written unpermuted (llama.cpp runs them with NeoX RoPE).

Mixture-of-experts files (Mixtral as "llama" with `expert_count`, "qwen2moe", "qwen3moe"): each layer's experts
are stacked in one 3-D tensor per projection (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`), yielded here as
every expert's raw rows under the architecture's per-expert checkpoint names (`CHECKPOINT_EXPERT_NAMES`), so
each expert runs as a GGUF linear of its own; the router (`ffn_gate_inp`) and Qwen2-MoE's shared-expert gate
(`ffn_gate_inp_shexp`) are dequantised. Every layer is sparse (llama.cpp's assumption too).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.fused_moe import CHECKPOINT_EXPERT_NAMES, ExpertNames
from llmctl.engine.model_config import ModelConfig

# general.architecture -> our architecture (Mistral files are written as "llama", Mixtral as "llama" with experts)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# whether the top-k routing weights are renormalised where the file has no expert_weights_norm (llama.cpp's
# own choice per architecture: Mixtral and Qwen3-MoE renormalise, Qwen2-MoE does not)
RENORMALIZE = {"llama": True, "qwen3moe": True, "qwen2moe": False}
EXPERT_PARTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
GATING_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
PERMUTED_ARCHITECTURES = ("llama",)
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
TENSOR_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)$")


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


class GGUFFile:
    def __init__(self, path: Path):
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError, IndexError, KeyError) as exc:
            raise ModelLoadError(f"{self.path.name} is not a readable GGUF file: {exc}") from None
        self.metadata: dict[str, Any] = {name: field.contents() for name, field in self.reader.fields.items()}
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}
        self.arch = str(self.metadata.get("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(f"{self.path.name}: GGUF architecture {self.arch!r} is not supported (supported: "
                                 f"{', '.join(ARCHITECTURES)})")
        self.num_experts = int(self.metadata.get(f"{self.arch}.expert_count", 0) or 0)
        mixtral = self.arch == "llama" and self.num_experts
        self.architecture = "MixtralForCausalLM" if mixtral else ARCHITECTURES[self.arch]
        self.expert_names: ExpertNames | None = CHECKPOINT_EXPERT_NAMES.get(self.architecture)

    def _arch_value(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{self.path.name}: GGUF metadata lacks {self.arch}.{key}")
        return value

    def model_config(self) -> ModelConfig:
        """The config, its quant_method naming the file's linear weight types (what the engine reports)."""
        config = ModelConfig.from_dict(self.config_dict(), source=self.path.name)
        return dataclasses.replace(config, quant_method=self.quantization_label())

    def quantization_label(self) -> str:
        """'gguf' and the linear weights' ggml types, most weights first (e.g. 'gguf Q4_K, Q6_K')."""
        counts = Counter(tensor.tensor_type.name for name, tensor in self.tensors.items()
                         if name.endswith(".weight") and name != "rope_freqs.weight" and self._is_linear(name))
        return "gguf " + ", ".join(kind for kind, _ in counts.most_common())

    def config_dict(self) -> dict[str, Any]:
        """The metadata as config.json keys."""
        self._refuse_unsupported()
        heads = int(self._arch_value("attention.head_count"))
        hidden = int(self._arch_value("embedding_length"))
        embedding = self._tensor("token_embd.weight")
        config = {
            "architectures": [self.architecture],
            "vocab_size": int(embedding.shape[1]),  # ggml order: [hidden, vocab]
            "hidden_size": hidden,
            "intermediate_size": int(self._arch_value(  # a MoE file may give its experts' only
                "feed_forward_length", self.metadata.get(f"{self.arch}.expert_feed_forward_length"))),
            "num_hidden_layers": int(self._arch_value("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch_value("attention.head_count_kv", heads)),
            "head_dim": int(self._arch_value("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self._arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self._arch_value("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "max_position_embeddings": int(self._arch_value("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.tensors and not self.head_from_embedding(),
            "attention_bias": self.arch == "llama" and "blk.0.attn_q.bias" in self.tensors,
            "torch_dtype": FLOAT_TYPES.get(embedding.tensor_type.name, "bfloat16"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
        }
        return {**config, **self._experts_config()} if self.num_experts else config

    def _experts_config(self) -> dict[str, Any]:
        """The routing facts under the architecture's config.json keys (`MoEConfig` reads them)."""
        gating = int(self.metadata.get(f"{self.arch}.expert_gating_func", GATING_SOFTMAX))
        if gating != GATING_SOFTMAX:
            raise ModelLoadError(f"{self.path.name}: expert_gating_func {gating} is not supported (softmax routing "
                                 "only)")
        used = int(self._arch_value("expert_used_count"))
        if self.arch == "llama":
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": used}
        shared = int(self.metadata.get(f"{self.arch}.expert_shared_feed_forward_length", 0) or 0)
        renormalize = bool(self.metadata.get(f"{self.arch}.expert_weights_norm", RENORMALIZE[self.arch]))
        return {"num_experts": self.num_experts, "num_experts_per_tok": used,
                "moe_intermediate_size": int(self._arch_value("expert_feed_forward_length")),
                "shared_expert_intermediate_size": shared, "norm_topk_prob": renormalize}

    def head_from_embedding(self) -> bool:
        """A tied file (no output.weight) whose token_embd is in a grouped type (`GROUPED_DECODERS`): its
        output matrix runs as an lm_head of its own from token_embd's blocks (`lm_head.qweight`, the quantised
        GEMV on the file's codes, as llama.cpp runs it) while the embedding lookup reads the dequantised table.
        Tying the lm_head to that table instead streamed it in bf16 (SmolLM-135M: 57 MB a token against Q8_0's
        30 MB) and kept its AMX tiles beside it."""
        from llmctl.engine.layers.quantization.gguf import GROUPED_DECODERS

        embedding = self.tensors.get("token_embd.weight")
        return ("output.weight" not in self.tensors and embedding is not None
                and embedding.tensor_type.name in GROUPED_DECODERS)

    def _refuse_unsupported(self) -> None:
        if self.num_experts and self.expert_names is None:
            raise ModelLoadError(f"{self.path.name}: GGUF architecture {self.arch!r} with experts is not supported")
        key, value = (self.metadata.get(f"{self.arch}.attention.{k}") for k in ("key_length", "value_length"))
        if key is not None and value is not None and key != value:
            raise ModelLoadError(f"{self.path.name}: attention key_length {key} != value_length {value}")

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self.metadata.get(f"{self.arch}.rope.scaling.type", "none")
        freqs = self.tensors.get("rope_freqs.weight")
        if freqs is not None:
            if kind not in ("none", "llama3"):
                raise ModelLoadError(f"{self.path.name}: rope_freqs with rope scaling type {kind!r} is not supported")
            # Llama 3.x: the converter stores the llama3 scaling as one divisor per rotary frequency
            factors = _dequantized(np.ascontiguousarray(freqs.data).view(np.uint8).reshape(1, -1), freqs).flatten()
            rotary = int(self._arch_value("attention.key_length", 0)) or (
                int(self._arch_value("embedding_length")) // int(self._arch_value("attention.head_count")))
            if factors.numel() != rotary // 2:
                raise ModelLoadError(f"{self.path.name}: rope_freqs has {factors.numel()} factors, expected "
                                     f"{rotary // 2} (head dim {rotary})")
            return {"rope_type": "rope_freqs", "factors": factors.tolist()}
        if kind == "none":
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self._arch_value("rope.scaling.factor"))}
        raise ModelLoadError(f"{self.path.name}: GGUF rope scaling type {kind!r} is not supported (supported: none, "
                             "linear)")

    def _tensor(self, name: str):
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path.name} has no tensor {name!r}")
        return tensor

    # ---- tensors ----------------------------------------------------------------------------------
    def iterate_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor): linear weights as `.qweight` (raw rows, uint8 [out, bytes]) and
        `.qweight_type` (the ggml type number); everything else float32."""
        heads = int(self._arch_value("attention.head_count"))
        kv_heads = int(self._arch_value("attention.head_count_kv", heads))
        head_from_embedding = self.head_from_embedding()
        for gguf_name, tensor in self.tensors.items():
            if gguf_name == "rope_freqs.weight":
                continue  # read into the config's rope scaling
            if _part(gguf_name) in EXPERT_PARTS:
                yield from self._expert_tensors(gguf_name, tensor)
                continue
            name = hf_name(gguf_name, self.path.name, self.expert_names)
            if name.endswith("shared_expert_gate.weight"):  # llama.cpp holds it as a vector
                yield name, _dequantized(_raw_rows(tensor, 1), tensor).reshape(1, -1)
                continue
            raw = _raw_rows(tensor, int(tensor.shape[1]) if len(tensor.shape) > 1 else 1)
            if self.arch in PERMUTED_ARCHITECTURES and re.search(r"\.(q|k)_proj\.", name):
                raw = unpermute_rows(raw, heads if ".q_proj." in name else kv_heads)
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
                yield name[: -len("weight")] + "qweight", torch.from_numpy(raw.copy())
                yield name[: -len("weight")] + "qweight_type", torch.tensor(int(tensor.tensor_type))
            else:
                yield name, _dequantized(raw, tensor).reshape(_torch_shape(tensor))
            if gguf_name == "token_embd.weight" and head_from_embedding:
                yield "lm_head.qweight", torch.from_numpy(raw.copy())
                yield "lm_head.qweight_type", torch.tensor(int(tensor.tensor_type))

    def _expert_tensors(self, gguf_name: str, tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A stacked [experts, rows, inputs] projection as each expert's raw rows (`.qweight`) and ggml type."""
        if self.expert_names is None or len(tensor.shape) != 3 or int(tensor.shape[2]) != self.num_experts:
            raise ModelLoadError(f"{self.path.name}: GGUF tensor {gguf_name!r} of shape {_torch_shape(tensor)} does "
                                 f"not hold {self.num_experts} experts (expert_count)")
        layer, part = TENSOR_NAME.match(gguf_name).group(1, 2)
        names = self.expert_names
        projection = {"gate": names.gate, "up": names.up, "down": names.down}[EXPERT_PARTS[part]]
        rows = int(tensor.shape[1])
        raw = _raw_rows(tensor, self.num_experts * rows)
        kind = torch.tensor(int(tensor.tensor_type))
        for expert in range(self.num_experts):
            name = f"model.layers.{layer}.{names.module}.experts.{expert}.{projection}."
            yield name + "qweight", torch.from_numpy(raw[expert * rows:(expert + 1) * rows].copy())
            yield name + "qweight_type", kind

    def _is_linear(self, gguf_name: str) -> bool:
        """A weight that runs as a linear (its ggml type is the file's quantisation): the experts' too."""
        if _part(gguf_name) in EXPERT_PARTS:
            return True
        return hf_name(gguf_name, self.path.name, self.expert_names).rsplit(".", 2)[-2] in LINEARS


def _part(gguf_name: str) -> str | None:
    """The tensor's kind in a GGUF name ("ffn_up_exps" in "blk.3.ffn_up_exps.weight")."""
    match = TENSOR_NAME.match(gguf_name)
    return match.group(2) if match else None


def _raw_rows(tensor, rows: int) -> np.ndarray:
    """The tensor's bytes as `rows` rows of whole ggml blocks."""
    return np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, -1)


def hf_name(gguf_name: str, source: str, expert_names: ExpertNames | None = None) -> str:
    """The Hugging Face name of a GGUF tensor (a router's under `expert_names`' module)."""
    match = TENSOR_NAME.match(gguf_name)
    base = None
    if match:
        layer, part, kind = match.groups()
        base = GLOBAL_NAMES.get(part) if layer is None else LAYER_NAMES.get(part)
        if part == "ffn_gate_inp" and expert_names is not None:
            base = f"{expert_names.module}.gate"
    if base is None:
        raise ModelLoadError(f"{source}: GGUF tensor {gguf_name!r} is not supported")
    prefix = "" if layer is None else f"model.layers.{layer}."
    return f"{prefix}{base}.{kind}"


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's q/k permute: per head, its rows (2, n / 2) were stored as (n / 2, 2)."""
    count = rows.shape[0]
    return rows.reshape(heads, count // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def _torch_shape(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))  # ggml's ne is innermost first


def _dequantized(raw: np.ndarray, tensor) -> torch.Tensor:
    from llmctl.engine.layers.quantization.gguf import dequantize_raw

    return dequantize_raw(raw, tensor.tensor_type.name, int(tensor.shape[0]))
