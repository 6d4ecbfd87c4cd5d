"""Pre-quantised GPTQ and AWQ checkpoints: a tiny random model's decoder linears are quantised and packed
here by packers that follow the published layouts (AutoGPTQ's `pack`, AutoAWQ's `WQLinear_GEMM.from_linear`),
saved with their quantization_config, loaded by llmctl, and compared with transformers running the
dequantised weights; every packer round-trips through the engine's unpacking; unsupported variants are
refused by name."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from test_generate_cli import run_cli
from test_parity import make_prompts, reference_logits
from test_quantization import assert_matches_reference, run_greedy, with_quantization_config

from llmctl.engine import LLM
from llmctl.engine.errors import EngineArgsError, ModelLoadError
from llmctl.engine.kernels.quant import load_quant_kernels
from llmctl.engine.layers.quantization.awq import AWQConfig
from llmctl.engine.layers.quantization.checkpoint import unpack_int32
from llmctl.engine.layers.quantization.gptq import GPTQConfig
from llmctl.engine.layers.linear import MergedColumnLinear, QKVLinear, RowLinear
from llmctl.engine.model_config import DECODER_LINEARS

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map: field k of a word holds output 8j + AWQ_ORDER[k]


# ---- the reference quantiser and packers (the published layouts, written independently of the engine) ----

@dataclass
class Quantised:
    """One linear quantised: codes [out, in] 0..2^bits-1, per-group zeros and float16 scales [groups, out],
    each input's group (g_idx), and the float32 weight they stand for."""
    codes: np.ndarray
    zeros: np.ndarray
    scales: np.ndarray
    g_idx: np.ndarray
    bits: int
    tensors: dict = field(default_factory=dict)  # the packed checkpoint tensors

    @property
    def dequantised(self) -> torch.Tensor:
        w = (self.codes - self.zeros[self.g_idx].T) * self.scales[self.g_idx].T.astype(np.float32)
        return torch.from_numpy(w.astype(np.float32))


def quantise(weight: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx: np.ndarray,
             min_zero: int = 0) -> Quantised:
    """GPTQ's min/max quantiser (AutoGPTQ `Quantizer.find_params`) per output row and group of inputs; the
    scale is rounded to float16 first, as the checkpoint stores it."""
    w = weight.detach().double().numpy()
    out_features, in_features = w.shape
    maxq = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    codes = np.zeros((out_features, in_features), dtype=np.int64)
    zeros = np.zeros((groups, out_features), dtype=np.int64)
    scales = np.zeros((groups, out_features), dtype=np.float16)
    for g in range(groups):
        cols = np.nonzero(g_idx == g)[0]
        block = w[:, cols]
        lo, hi = np.minimum(block.min(axis=1), 0), np.maximum(block.max(axis=1), 0)
        if sym:
            hi = np.maximum(-lo, hi)
            lo = -hi
        scale = ((hi - lo) / maxq).astype(np.float16)
        scale[scale == 0] = 1
        zero = np.full(out_features, (maxq + 1) // 2) if sym else np.clip(np.round(-lo / scale), min_zero, maxq)
        codes[:, cols] = np.clip(np.round(block / scale.astype(np.float64)[:, None]) + zero[:, None], 0, maxq)
        zeros[g], scales[g] = zero, scale
    return Quantised(codes, zeros, scales, g_idx.astype(np.int32), bits)


def words(fields: np.ndarray, bits: int) -> np.ndarray:
    """[..., n, 32/bits] field values -> [..., n] int32 words, field k at bits bits*k."""
    per_word = 32 // bits
    acc = np.zeros(fields.shape[:-1], dtype=np.uint32)
    for k in range(per_word):
        acc |= (fields[..., k].astype(np.uint32) & np.uint32((1 << bits) - 1)) << np.uint32(bits * k)
    return acc.view(np.int32)


def pack_gptq(q: Quantised, zero_offset: int) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout: qweight [in/p, out] packs inputs, qzeros [G, out/p] packs outputs (zero - 1 in v1)."""
    per_word = 32 // q.bits
    intweight = q.codes.T  # [in, out]
    qweight = words(intweight.reshape(-1, per_word, intweight.shape[1]).transpose(0, 2, 1), q.bits)
    stored = q.zeros - zero_offset
    assert stored.min() >= 0, "v1 cannot store a zero of 0"
    qzeros = words(stored.reshape(stored.shape[0], -1, per_word), q.bits)
    return {"qweight": torch.from_numpy(qweight.copy()), "qzeros": torch.from_numpy(qzeros.copy()),
            "scales": torch.from_numpy(q.scales.copy()), "g_idx": torch.from_numpy(q.g_idx.copy())}


def pack_awq(q: Quantised) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: qweight [in, out/8] and qzeros [G, out/8] pack outputs in AWQ_ORDER."""
    def interleaved(values: np.ndarray) -> np.ndarray:  # [rows, out] -> [rows, out/8] words
        runs = values.reshape(values.shape[0], -1, 8)
        return words(runs[..., AWQ_ORDER], 4)
    return {"qweight": torch.from_numpy(interleaved(q.codes.T)), "qzeros": torch.from_numpy(interleaved(q.zeros)),
            "scales": torch.from_numpy(q.scales.copy())}


def group_index(in_features: int, group_size: int, act_order: bool, rng: np.random.Generator,
                blocks: int = 1) -> np.ndarray:
    """`blocks`: the act-order permutation stays within each of that many equal input blocks (so a
    tensor-parallel split of the inputs in `blocks` parts keeps every group on one rank)."""
    group = in_features if group_size == -1 else group_size
    if not act_order:
        return np.arange(in_features) // group
    if blocks == 1:
        perm = rng.permutation(in_features)  # the order GPTQ quantised the inputs in
    else:
        width = in_features // blocks
        perm = np.concatenate([block * width + rng.permutation(width) for block in range(blocks)])
    g_idx = np.empty(in_features, dtype=np.int64)
    g_idx[perm] = np.arange(in_features) // group
    return g_idx


@dataclass(frozen=True)
class Scheme:
    method: str  # gptq | awq
    bits: int = 4
    group_size: int = 32
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"
    order_blocks: int = 1  # act-order permutations within this many input blocks (group_index's `blocks`)

    @property
    def quantization_config(self) -> dict:
        # with the keys real checkpoints carry beside the ones that matter (AutoAWQ / transformers, GPTQModel)
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "backend": "autoawq", "modules_to_not_convert": ["visual"]}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": self.sym, "checkpoint_format": self.checkpoint_format, "damp_percent": 0.01,
                "true_sequential": True, "static_groups": False, "pack_dtype": "int32", "lm_head": False,
                "modules_in_block_to_quantize": [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"],
                                                 ["self_attn.o_proj"], ["mlp.up_proj", "mlp.gate_proj"],
                                                 ["mlp.down_proj"]]}

    def quantise(self, weight: torch.Tensor, g_idx: np.ndarray) -> Quantised:
        v1 = self.method == "gptq" and self.checkpoint_format == "gptq"
        q = quantise(weight, self.bits, self.group_size, self.sym and self.method == "gptq", g_idx,
                     min_zero=1 if v1 else 0)
        q.tensors = pack_awq(q) if self.method == "awq" else pack_gptq(q, 1 if v1 else 0)
        return q


FUSED_INPUTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def shared_input(module: str) -> str:
    """q/k/v of a layer read one input, gate/up another: the name of the input `module` reads."""
    prefix, projection = module.rsplit(".", 1)
    return f"{prefix}.{FUSED_INPUTS.get(projection, projection)}"


def write_quantised_checkpoint(source, folder, scheme: Scheme, seed: int = 0) -> dict[str, torch.Tensor]:
    """Copy the float32 checkpoint `source` to `folder` with every decoder linear quantised and packed by
    `scheme`; returns the dequantised weight of each linear by its Hugging Face name. The q/k/v (and
    gate/up) of a layer share one act-order input order, as GPTQ gives them (same input, same Hessian)."""
    shutil.copytree(source, folder)
    state = load_file(str(folder / "model.safetensors"))
    rng = np.random.default_rng(seed)
    dequantised, orders = {}, {}
    for name in sorted(state):
        module = name.removesuffix(".weight")
        if not module.endswith(DECODER_LINEARS) or not name.endswith(".weight"):
            continue
        weight = state.pop(name)
        if shared_input(module) not in orders:
            orders[shared_input(module)] = group_index(weight.shape[1], scheme.group_size, scheme.desc_act, rng,
                                                       scheme.order_blocks)
        q = scheme.quantise(weight, orders[shared_input(module)])
        state.update({f"{module}.{key}": tensor for key, tensor in q.tensors.items()})
        dequantised[module] = q.dequantised
    save_file(state, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = scheme.quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return dequantised


def dequantised_model(source, dequantised: dict[str, torch.Tensor]):
    """transformers' float32 model with each decoder linear holding its dequantised weight."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for name, weight in dequantised.items():
        model.get_submodule(name).weight = nn.Parameter(weight, requires_grad=False)
    return model


# ---- engine against transformers on the dequantised weights -------------------------------------------

SCHEMES = {
    "gptq-4bit-g32-sym": ("llama", Scheme("gptq")),
    "gptq-4bit-g32-asym-act-order": ("qwen2", Scheme("gptq", sym=False, desc_act=True)),  # tied, q/k/v bias
    "gptq-8bit-channel-asym": ("llama", Scheme("gptq", bits=8, group_size=-1, sym=False)),
    "gptq-v2-4bit-g64-asym": ("mistral", Scheme("gptq", group_size=64, sym=False, checkpoint_format="gptq_v2")),
    "gptq-8bit-g32-sym-act-order": ("qwen3", Scheme("gptq", bits=8, desc_act=True)),
    "awq-g32": ("llama", Scheme("awq")),
    "awq-g64": ("qwen2", Scheme("awq", group_size=64)),
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_checkpoint_matches_transformers_on_the_dequantised_weights(tiny_models, tmp_path, name):
    from transformers import AutoModelForCausalLM

    arch, scheme = SCHEMES[name]
    source = tiny_models[arch]
    folder = tmp_path / name
    reference = dequantised_model(source, write_quantised_checkpoint(source, folder, scheme))
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=400,
              max_num_batched_tokens=96)
    unquantised = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    assert_matches_reference(llm, reference, unquantised, make_prompts(512)[:3], tolerance=1e-2)


# bfloat16 on CPU runs the native kernels (engine/kernels/quant_*.c) where they build, else torch's
# int4 kernel (int4pack) for 4-bit groups of 32..256 and its int8 kernel for symmetric per-channel 8-bit; the
# act-order input permutation is applied to the activations first
_NATIVE = load_quant_kernels() is not None
BF16_LAYOUTS = {
    "gptq-4bit-g32-asym-act-order": ("llama", Scheme("gptq", sym=False, desc_act=True),
                                     "native" if _NATIVE else "int4pack"),
    "gptq-8bit-channel-sym": ("qwen2", Scheme("gptq", bits=8, group_size=-1), "native" if _NATIVE else "int8pack"),
    "awq-g64": ("llama", Scheme("awq", group_size=64), "native" if _NATIVE else "int4pack"),
}


@pytest.mark.parametrize("name", sorted(BF16_LAYOUTS))
def test_bfloat16_engine_tracks_the_dequantised_weights(tiny_models, tmp_path, name):
    arch, scheme, layout = BF16_LAYOUTS[name]
    source, folder = tiny_models[arch], tmp_path / name
    reference = dequantised_model(source, write_quantised_checkpoint(source, folder, scheme))
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", device="cpu", max_model_len=400)
    model = llm.engine.executor.runner.model
    assert {m.quant_layout for m in model.model.layers.modules() if hasattr(m, "quant_layout")} == {layout}
    for prompt, tokens, ours in run_greedy(llm, make_prompts(512)[:2]):
        expected = reference_logits(reference, prompt, tokens)
        assert (ours.float() - expected).abs().max().item() < 0.05 * expected.abs().max().item() + 0.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["gptq-4bit-g32-asym-act-order", "awq-g32"])
def test_checkpoint_runs_on_cuda(tiny_models, tmp_path, name):
    arch, scheme = SCHEMES[name]
    source, folder = tiny_models[arch], tmp_path / name
    reference = dequantised_model(source, write_quantised_checkpoint(source, folder, scheme))
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cuda", max_model_len=400)
    for prompt, tokens, ours in run_greedy(llm, make_prompts(512)[:2]):
        assert (ours.cpu() - reference_logits(reference, prompt, tokens)).abs().max().item() < 1e-2


def test_generate_runs_a_gptq_checkpoint(tiny_chat_model, tmp_path):
    folder = tmp_path / "gptq"
    write_quantised_checkpoint(tiny_chat_model, folder, Scheme("gptq"))
    proc = run_cli("generate", "hi", "-m", str(folder), "--max-tokens", "3", "--json", "--quantization", "gptq")
    assert proc.returncode == 0, proc.stderr  # the checkpoint's own method named, as vLLM accepts it
    assert "gptq" in json.loads(proc.stdout.splitlines()[-1])["quantization"].lower()


# ---- packers against the engine's unpacking --------------------------------------------------------------

def test_unpack_reads_the_documented_bit_positions():
    # GPTQ: field k (bits 4k..4k+3) is element k; AWQ: field k is element AWQ_ORDER[k]
    assert unpack_int32(torch.tensor([[0x76543210]], dtype=torch.int32), 4, dim=1).tolist() == [list(range(8))]
    assert unpack_int32(torch.tensor([[0x75316420]], dtype=torch.int32), 4, dim=1,
                        order=AWQ_ORDER).tolist() == [list(range(8))]
    packed = np.array([[0x04030201, -0x01020304]], dtype=np.int64).astype(np.int32)  # 8-bit fields, sign bit set
    assert unpack_int32(torch.from_numpy(packed), 8, dim=1).tolist() == [[1, 2, 3, 4, 0xFC, 0xFC, 0xFD, 0xFE]]
    assert unpack_int32(torch.tensor([[0x76543210], [0x10101010]], dtype=torch.int32), 4, dim=0)[:, 0].tolist() == \
        [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 0, 1, 0, 1, 0, 1]


def test_gptq_v1_reads_a_stored_fifteen_as_sixteen():
    """v1 stores zero - 1; the readers (AutoGPTQ, vLLM) add 1 back without wrapping."""
    layer = loaded_layer(Scheme("gptq", sym=False), lambda: RowLinear(64, 8, False, method(Scheme("gptq", sym=False)),
                                                                        torch.float32), zero_fill=-1)
    assert int(layer.method.grouped_weight(layer).zeros.max()) == 16


def method(scheme: Scheme):
    config = AWQConfig(group_size=scheme.group_size) if scheme.method == "awq" else GPTQConfig(
        bits=scheme.bits, group_size=scheme.group_size, desc_act=scheme.desc_act, sym=scheme.sym,
        checkpoint_format=scheme.checkpoint_format)
    return config.linear_method()


def loaded_layer(scheme: Scheme, build, zero_fill: Optional[int] = None, seed: int = 0):
    """A layer built with the scheme's method, each output shard quantised and packed separately (as the
    checkpoint's q/k/v or gate/up) and loaded through the parameters' weight loaders. Returns the layer with
    `.reference` (the packer's Quantised of the whole weight)."""
    layer = build()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    g_idx = group_index(layer.in_features, scheme.group_size, scheme.desc_act, rng)
    pieces = []
    for shard, (_, size) in layer.output_offsets.items():
        q = scheme.quantise(torch.randn(size, layer.in_features), g_idx)
        if zero_fill is not None:
            q.tensors["qzeros"].fill_(zero_fill)
        for key, tensor in q.tensors.items():
            param = getattr(layer, key)
            param.weight_loader(param, tensor, shard)
        pieces.append(q)
    layer.reference = Quantised(np.concatenate([q.codes for q in pieces]), np.concatenate([q.zeros for q in pieces], 1),
                                np.concatenate([q.scales for q in pieces], 1), g_idx.astype(np.int32), scheme.bits)
    return layer


ROUND_TRIPS = {
    "gptq-4bit-g32-sym": Scheme("gptq"),
    "gptq-4bit-g16-asym-act-order": Scheme("gptq", group_size=16, sym=False, desc_act=True),
    "gptq-4bit-channel-asym": Scheme("gptq", group_size=-1, sym=False),
    "gptq-8bit-g32-asym": Scheme("gptq", bits=8, sym=False),
    "gptq-8bit-g64-sym-act-order": Scheme("gptq", bits=8, group_size=64, desc_act=True),
    "gptq-v2-4bit-g32-asym": Scheme("gptq", sym=False, checkpoint_format="gptq_v2"),
    "awq-g32": Scheme("awq"),
    "awq-channel": Scheme("awq", group_size=-1),
}
LAYERS = {
    "qkv": lambda m: QKVLinear(128, 64, 32, True, m, torch.float32),
    "gate_up": lambda m: MergedColumnLinear(128, [48, 48], False, m, torch.float32),
    "row": lambda m: RowLinear(128, 40, False, m, torch.float32),
}


@pytest.mark.parametrize("layer_kind", sorted(LAYERS))
@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_packed_shards_unpack_to_the_packers_codes(name, layer_kind):
    scheme = ROUND_TRIPS[name]
    layer = loaded_layer(scheme, lambda: LAYERS[layer_kind](method(scheme)))
    reference = layer.reference
    unpacked = layer.method.grouped_weight(layer)
    group = layer.in_features if scheme.group_size == -1 else scheme.group_size
    assert unpacked.bits == scheme.bits and unpacked.group_size == group
    perm = torch.arange(layer.in_features) if unpacked.perm is None else unpacked.perm
    assert (unpacked.perm is not None) == scheme.desc_act
    order = torch.argsort(perm)  # unpacked column order -> the inputs' own order
    assert torch.equal(unpacked.codes[:, order].long(), torch.from_numpy(reference.codes))
    assert torch.equal(unpacked.scales, torch.from_numpy(reference.scales.T.astype(np.float32)))
    zeros = reference.zeros.T
    if unpacked.zeros is None:
        assert scheme.sym and (zeros == 1 << (scheme.bits - 1)).all()
    else:
        assert torch.equal(unpacked.zeros.long(), torch.from_numpy(zeros))
    assert torch.allclose(unpacked.dequantize(), reference.dequantised, atol=0, rtol=0)
    # each group's inputs lie side by side in the unpacked order
    groups = torch.from_numpy(reference.g_idx).long()[perm]
    assert torch.equal(groups, torch.arange(layer.in_features) // group)


def test_loaded_layer_applies_the_dequantised_weight():
    scheme = Scheme("gptq", sym=False, desc_act=True)
    layer = loaded_layer(scheme, lambda: QKVLinear(128, 64, 32, True, method(scheme), torch.float32))
    bias = torch.randn(layer.out_features)
    layer.bias.weight_loader(layer.bias, bias[:64], "q")
    layer.bias.weight_loader(layer.bias, bias[64:96], "k")
    layer.bias.weight_loader(layer.bias, bias[96:], "v")
    reference = layer.reference.dequantised
    layer.process_weights_after_loading()
    assert not hasattr(layer, "qweight") and not hasattr(layer, "g_idx")
    x = torch.randn(5, 128)
    assert torch.allclose(layer(x), x @ reference.T + bias, atol=1e-4)


# ---- refusals ------------------------------------------------------------------------------------------

REFUSED = {
    "gptq-3bit": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ 3-bit checkpoints are not supported"),
    "gptq-2bit": ({"quant_method": "gptq", "bits": 2, "group_size": 128}, "GPTQ 2-bit checkpoints are not supported"),
    "gptq-marlin": ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True},
                    "GPTQ checkpoint_format 'marlin' is not supported"),
    "gptq-format": ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v3"},
                    "GPTQ checkpoint_format 'gptq_v3' is not supported"),
    "gptq-gptqmodel-format": ({"quant_method": "gptq", "bits": 4, "format": "bitblas"},
                              "GPTQ checkpoint_format 'bitblas' is not supported"),
    "gptq-pack-dtype": ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"},
                        "GPTQ pack_dtype 'int16' is not supported"),
    "gptq-lm-head": ({"quant_method": "gptq", "bits": 4, "lm_head": True}, "quantised lm_head"),
    "gptq-partial": ({"quant_method": "gptq", "bits": 4,
                      "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]]},
                     "leaves mlp.down_proj, mlp.gate_proj, mlp.up_proj, self_attn.o_proj unquantised"),
    "gptq-group": ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size must be positive or -1"),
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "version": "GEMV"}, "AWQ version 'gemv' is not supported"),
    "awq-8bit": ({"quant_method": "awq", "bits": 8, "version": "gemm"}, "AWQ 8-bit checkpoints are not supported"),
    "awq-no-zero": ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point: false"),
    "awq-partial": ({"quant_method": "awq", "bits": 4, "modules_to_not_convert": ["visual", "mlp.down_proj"]},
                    "keeps decoder linears (mlp.down_proj) unquantised"),
    "unknown": ({"quant_method": "mystery-quant"}, "quant_method 'mystery-quant' is not supported (pre-quantised "
                                                   "checkpoints: compressed-tensors, gptq, awq"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_variant_is_refused_by_name(tiny_models, tmp_path, name):
    quant_config, expected = REFUSED[name]
    folder = with_quantization_config(tiny_models["llama"], tmp_path / "q", quant_config)
    with pytest.raises(ModelLoadError) as info:
        LLM(str(folder), skip_tokenizer_init=True, device="cpu", max_model_len=64, num_kv_blocks=8)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_generate_refuses_gptq_3bit_in_one_line(tiny_chat_model, tmp_path):
    folder = with_quantization_config(tiny_chat_model, tmp_path / "q", REFUSED["gptq-3bit"][0])
    proc = run_cli("generate", "hi", "-m", str(folder), "--max-tokens", "2")
    assert proc.returncode == 2
    error_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(error_lines) == 1 and "GPTQ 3-bit checkpoints are not supported" in error_lines[0]


def test_on_the_fly_quantization_of_a_quantised_checkpoint_is_refused(tiny_models, tmp_path):
    folder = tmp_path / "gptq"
    write_quantised_checkpoint(tiny_models["llama"], folder, Scheme("gptq"))
    with pytest.raises(EngineArgsError, match=r"the checkpoint is already quantised \(gptq\); drop --quantization int8"):
        LLM(str(folder), skip_tokenizer_init=True, device="cpu", quantization="int8", max_model_len=64, num_kv_blocks=8)
    with pytest.raises(EngineArgsError, match="--quantization awq names a pre-quantised format, but the checkpoint is "
                                              "quantised with gptq"):
        LLM(str(folder), skip_tokenizer_init=True, device="cpu", quantization="awq", max_model_len=64, num_kv_blocks=8)
    with pytest.raises(EngineArgsError, match="--load-format dummy cannot fill a pre-quantised"):
        LLM(str(folder), skip_tokenizer_init=True, device="cpu", load_format="dummy", max_model_len=64,
            num_kv_blocks=8)


def test_fused_shards_with_different_act_orders_are_refused(tiny_models, tmp_path):
    folder = tmp_path / "gptq"
    write_quantised_checkpoint(tiny_models["llama"], folder, Scheme("gptq", desc_act=True))
    state = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="fused shards 'q' and 'k' have different g_idx"):
        LLM(str(folder), skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8)


def without_tensors(folder, suffix: str) -> None:
    state = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in state.items() if not k.endswith(suffix)}, str(folder / "model.safetensors"))


@pytest.mark.parametrize("scheme, missing", [(Scheme("awq"), "model.layers.0.mlp.up_proj.qzeros"),
                                             (Scheme("gptq", desc_act=True), "model.layers.1.self_attn.k_proj.g_idx")])
def test_a_missing_packed_tensor_is_named(tiny_models, tmp_path, scheme, missing):
    folder = tmp_path / "q"
    write_quantised_checkpoint(tiny_models["llama"], folder, scheme)
    without_tensors(folder, missing)
    with pytest.raises(ModelLoadError, match=f"missing tensor '{missing}'"):
        LLM(str(folder), skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8)


def test_gptq_without_act_order_loads_without_g_idx(tiny_models, tmp_path):
    """g_idx is i / group_size without desc_act, so a checkpoint may leave it out."""
    source, folder = tiny_models["llama"], tmp_path / "q"
    reference = dequantised_model(source, write_quantised_checkpoint(source, folder, Scheme("gptq", sym=False)))
    without_tensors(folder, ".g_idx")
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=400)
    for prompt, tokens, ours in run_greedy(llm, make_prompts(512)[:1]):
        assert (ours - reference_logits(reference, prompt, tokens)).abs().max().item() < 1e-2
