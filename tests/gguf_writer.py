"""Test-side GGUF conversion of a tiny Hugging Face model, the way llama.cpp's convert_hf_to_gguf.py writes it:
the gguf package's writer and tensor-name map, its quantisers for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/TQ2_0/BF16 and
round-to-nearest Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS packers written here from ggml's block layouts (the gguf package
only dequantises those; its dequantisers check these packers). Llama q/k rows are permuted as the converter does.
Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) get the converter's expert metadata and each layer's
experts stacked per projection (`ffn_gate_exps`, ...); routers and the shared-expert gate stay F32 as it keeps them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

QK_K = 256


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _k_scales_mins(rows: np.ndarray, levels: int) -> tuple:
    """Q4_K/Q5_K's rounding: per 32 values a 6-bit scale and min against the super-block's float16 d and dmin,
    codes 0..levels; returns the codes [n, k, 8, 32] and the 12 packed scale bytes, d and dmin per super-block."""
    n = rows.shape[0]
    x = rows.astype(np.float32).reshape(n, -1, 8, 32)
    low = np.minimum(x.min(-1), 0)
    span = (x.max(-1) - low) / levels
    d = (span.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(span / np.where(d == 0, 1, d)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.where(dmin == 0, 1, dmin)[..., None]), 0, 63).astype(np.uint8)
    scale = d[..., None] * sc
    q = np.clip(np.round((x + (dmin[..., None] * m)[..., None]) / np.where(scale == 0, 1, scale)[..., None]), 0, levels)
    packed_scales = np.concatenate([
        (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
        (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
        (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4),
    ], axis=-1)
    return q.astype(np.uint8), packed_scales, d, dmin


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """float [n, k * 256] -> Q4_K blocks uint8 [n, k * 144]: w = d * sc * q - dmin * m, q 0..15."""
    n = rows.shape[0]
    q, packed_scales, d, dmin = _k_scales_mins(rows, 15)
    q = q.reshape(n, -1, 4, 2, 32)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, -1, 128)
    blocks = np.concatenate([_f16(d), _f16(dmin), packed_scales, qs], axis=-1)
    return blocks.reshape(n, -1)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    """float [n, k * 256] -> Q5_K blocks uint8 [n, k * 176]: Q4_K's scales and mins, q 0..31 as a nibble
    (sub-blocks 2c and 2c + 1 share qs chunk c) and a high bit (sub-block s: bit s of qh's 32 bytes)."""
    n = rows.shape[0]
    q, packed_scales, d, dmin = _k_scales_mins(rows, 31)
    low, high = q & 0xF, q >> 4  # [n, k, 8, 32]
    qs = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(n, -1, 128)
    qh = np.zeros(high.shape[:2] + (32,), dtype=np.uint8)
    for sub in range(8):
        qh |= high[:, :, sub] << sub
    blocks = np.concatenate([_f16(d), _f16(dmin), packed_scales, qh, qs], axis=-1)
    return blocks.reshape(n, -1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """float [n, k * 256] -> Q6_K blocks uint8 [n, k * 210]: ql (low 4 bits), qh (high 2 bits), int8 scales
    per 16 values, float16 d; w = d * sc * (q - 32)."""
    n = rows.shape[0]
    x = rows.astype(np.float32).reshape(n, -1, 16, 16)
    sub = np.abs(x).max(-1) / 31
    d = (np.abs(sub).max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(sub / np.where(d == 0, 1, d)[..., None]), -128, 127).astype(np.int8)
    scale = d[..., None] * sc
    q = np.clip(np.round(x / np.where(scale == 0, 1, scale)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, -1, 2, 4, 32)  # value = half * 128 + quarter * 32 + lane
    low, high = q & 0xF, q >> 4
    ql = np.concatenate([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)],
                        axis=-1)  # per half: 64 bytes, quarters 0/2 then 1/3 share bytes
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
    blocks = np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8), _f16(d)], axis=-1)
    return blocks.reshape(n, -1)


def _iq4_grid() -> np.ndarray:
    from gguf.quants import IQ4_NL

    return np.array(IQ4_NL.kvalues, dtype=np.float32)


def _iq4_indices(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The nearest grid value's index for each of x's values / scale (scale broadcast over x's last axis)."""
    ratio = x / np.where(scale == 0, 1, scale)[..., None]
    return np.abs(ratio[..., None] - _iq4_grid()).argmin(-1).astype(np.uint8)


def _iq4_nibbles(index: np.ndarray) -> np.ndarray:
    """[..., 32] indices -> [..., 16] bytes: values 0..15 in the low nibbles, 16..31 in the high ones."""
    return index[..., :16] | (index[..., 16:] << 4)


def quantize_iq4_nl(rows: np.ndarray) -> np.ndarray:
    """float [n, k * 32] -> IQ4_NL blocks uint8 [n, k * 18]: float16 d (the block's largest magnitude onto the
    grid's -127), nibbles indexing the grid; w = d * grid[q]."""
    n = rows.shape[0]
    x = rows.astype(np.float32).reshape(n, -1, 32)
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    d = (-peak / 127).astype(np.float16).astype(np.float32)
    return np.concatenate([_f16(d), _iq4_nibbles(_iq4_indices(x, d))], axis=-1).reshape(n, -1)


def quantize_iq4_xs(rows: np.ndarray) -> np.ndarray:
    """float [n, k * 256] -> IQ4_XS blocks uint8 [n, k * 136]: float16 d, per 32 values a 6-bit scale ls
    (scales_h: 2 bits each, scales_l: a nibble each), nibbles indexing IQ4_NL's grid; w = d * (ls - 32) * grid[q]."""
    n = rows.shape[0]
    x = rows.astype(np.float32).reshape(n, -1, 8, 32)
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    ideal = -peak / 127  # [n, k, 8]
    d = (np.abs(ideal).max(-1) / 31).astype(np.float16).astype(np.float32)
    ls = (np.clip(np.round(ideal / np.where(d == 0, 1, d)[..., None]), -32, 31) + 32).astype(np.uint16)
    index = _iq4_indices(x, d[..., None] * (ls.astype(np.float32) - 32))
    scales_h = np.zeros(ls.shape[:2], dtype=np.uint16)
    for sub in range(8):
        scales_h |= (ls[..., sub] >> 4) << (2 * sub)
    low = (ls & 0x0F).astype(np.uint8)
    scales_l = low[..., 0::2] | (low[..., 1::2] << 4)
    blocks = np.concatenate([_f16(d), scales_h[..., None].view(np.uint8), scales_l,
                             _iq4_nibbles(index).reshape(n, -1, 128)], axis=-1)
    return blocks.reshape(n, -1)


def quantize(rows: np.ndarray, type_name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if type_name == "Q4_K":
        return quantize_q4_k(rows)
    if type_name == "Q5_K":
        return quantize_q5_k(rows)
    if type_name == "IQ4_NL":
        return quantize_iq4_nl(rows)
    if type_name == "IQ4_XS":
        return quantize_iq4_xs(rows)
    if type_name == "Q6_K":
        return quantize_q6_k(rows)
    if type_name == "F32":
        return rows.astype(np.float32)
    if type_name == "F16":
        return rows.astype(np.float16)
    return gguf_quantize(rows.astype(np.float32), GGMLQuantizationType[type_name])


def dequantize(blocks: np.ndarray, type_name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float32)


def llama_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rows of any per-row data)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: one divisor per rotary frequency."""
    import math

    factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_tokenizer(writer, tokenizer_folder: Path, pre: str = "default") -> None:
    """tokenizer.json (byte-level BPE) as llama.cpp's gpt2 vocabulary: tokens by id, merges, types."""
    data = json.loads((tokenizer_folder / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [None] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    config_path = tokenizer_folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id)):
        if config.get(key) in vocab:
            add(vocab[config[key]])
    post = data.get("post_processor") or {}
    writer.add_add_bos_token(post.get("type") == "TemplateProcessing")
    if config.get("chat_template"):
        writer.add_chat_template(config["chat_template"])


ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
         "Qwen3MoeForCausalLM": "qwen3moe"}
EXPERT_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
EXPERT_PROJECTIONS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
F32_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # the converter keeps routers in F32


def add_moe_metadata(writer, config: dict, arch: str) -> None:
    """convert_hf_to_gguf.py's expert keys: Mixtral's experts use feed_forward_length, Qwen's their own."""
    writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])  # transformers 5: local
    if arch != "llama":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_expert_used_count(config["num_experts_per_tok"])


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, tuple[list[str], np.ndarray]]:
    """Per-expert tensors taken out of `state`, as {GGUF name: (their HF names by expert, stacked [E, out, in])}."""
    found: dict[str, dict[int, tuple[str, np.ndarray]]] = {}
    for name in [n for n in state if EXPERT_TENSOR.match(n)]:
        layer, expert, projection = EXPERT_TENSOR.match(name).groups()
        gguf_name = f"blk.{layer}.ffn_{EXPERT_PROJECTIONS[projection]}_exps.weight"
        found.setdefault(gguf_name, {})[int(expert)] = (name, state.pop(name).float().numpy())
    return {gguf_name: ([experts[e][0] for e in sorted(experts)], np.stack([experts[e][1] for e in sorted(experts)]))
            for gguf_name, experts in found.items()}


def write_tensor(writer, gguf_name: str, values: np.ndarray, kind: str, permute_heads: int = 0) -> np.ndarray:
    """Add `values` (rows in the last dimension) as `kind`, its rows llama-permuted over `permute_heads` heads
    (0: not); returns the float32 values the file holds, unpermuted."""
    rows = values.reshape(-1, values.shape[-1])
    data = quantize(rows, kind)
    held = data.astype(np.float32) if kind in ("F32", "F16") else dequantize(data, kind)
    if permute_heads:
        data = llama_permute(data, permute_heads)
    data = data.reshape(*values.shape[:-1], data.shape[-1])
    if kind in ("F32", "F16"):
        writer.add_tensor(gguf_name, data)
    else:
        import gguf

        writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
    return held.reshape(values.shape)


def write_gguf(source: Path, path: Path, types: dict[str, str], tokenizer_folder: Path | None = None,
               default_type: str = "F32") -> dict[str, np.ndarray]:
    """Convert the float32 Hugging Face model in `source` to `path`; `types` maps a GGUF tensor name's suffix
    (e.g. "attn_v.weight", "blk.0.ffn_down.weight") to its ggml type, 2-D weights default to `default_type`,
    1-D tensors stay F32. Returns the Hugging Face-order float32 weights the file holds (dequantised)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((source / "config.json").read_text())
    arch = ARCHS[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or config  # transformers 5 nests it
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type") == "llama3" else (config.get("rope_scaling") or {})
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, rope.get("rope_theta", 10000.0), scaling))
    if tokenizer_folder is not None:
        write_tokenizer(writer, tokenizer_folder)
    if config.get("num_experts_per_tok"):
        add_moe_metadata(writer, config, arch)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    held: dict[str, np.ndarray] = {}
    state = load_file(str(source / "model.safetensors"))
    for gguf_name, (hf_names, stacked) in stack_experts(state).items():
        kind = next((t for suffix, t in types.items() if gguf_name.endswith(suffix)), default_type)
        held.update(zip(hf_names, write_tensor(writer, gguf_name, stacked, kind)))
    for hf_name, tensor in state.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        values = tensor.float().numpy()
        if values.ndim == 1 or gguf_name.endswith(F32_TENSORS):
            kind = "F32"
        else:
            kind = next((t for suffix, t in types.items() if gguf_name.endswith(suffix)), default_type)
        permuted = arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name)
        held[hf_name] = write_tensor(writer, gguf_name, values, kind,
                                     (heads if ".q_proj." in hf_name else kv_heads) if permuted else 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def reference_model(source: Path, held: dict[str, np.ndarray]):
    """transformers' float32 model with the weights the GGUF file holds."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    state = {name: torch.from_numpy(values) for name, values in held.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(name == "lm_head.weight" for name in missing), (missing, unexpected)
    return model


def saved_reference_model(source: Path, held: dict[str, np.ndarray], folder: Path):
    """transformers' float32 model with the weights the GGUF file holds, saved under their Hugging Face names in
    `folder` and loaded by transformers (which fuses a mixture-of-experts model's per-expert tensors itself)."""
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text((source / "config.json").read_text())
    save_file({name: np.ascontiguousarray(values, dtype=np.float32) for name, values in held.items()},
              str(folder / "model.safetensors"))
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()
