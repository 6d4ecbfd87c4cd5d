"""Linear layers and their methods: fused-shard weight loaders, shape and missing-shard errors, the CPU
packed methods against F.linear, and new methods defined in this file alone: a weight stored transposed
running the engine in parity with transformers (a new method is one class), weight-only int8 with
parameters and loaders of its own, and one rank's tensor-parallel shard."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_parity import LogitRecorder, make_prompts, reference_logits

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import ModelLoadError
from llmctl.engine.kernels import load_cpu_kernels
from llmctl.engine.layers.linear import (
    LinearBase,
    LinearMethod,
    MergedColumnLinear,
    MKLLinearMethod,
    OneDNNLinearMethod,
    QKVLinear,
    RowLinear,
    UnquantizedLinearMethod,
    WeightShapeError,
    copy_checked,
    new_parameter,
    register_weight_and_bias,
    select_linear_method,
)
from llmctl.engine.loader import WeightLoader
from llmctl.engine.model_config import ModelConfig
from llmctl.engine.models.llama import LlamaForCausalLM


def load_shards(layer: LinearBase, tensors: dict) -> None:
    for name, param in layer.named_parameters():
        for shard, tensor in tensors[name].items():
            param.weight_loader(param, tensor, shard)


def test_qkv_shards_land_in_their_rows_and_the_forward_is_the_three_projections():
    layer = QKVLinear(8, q_size=12, kv_size=4, bias=True, method=UnquantizedLinearMethod(), dtype=torch.float32)
    weights = {s: torch.randn(n, 8) for s, n in (("q", 12), ("k", 4), ("v", 4))}
    biases = {s: torch.randn(w.shape[0]) for s, w in weights.items()}
    load_shards(layer, {"weight": weights, "bias": biases})
    assert layer.weight.shard_ids == ("q", "k", "v")
    assert torch.equal(layer.weight, torch.cat([weights["q"], weights["k"], weights["v"]]))
    x = torch.randn(3, 8)
    expected = torch.cat([F.linear(x, weights[s], biases[s]) for s in "qkv"], dim=-1)
    assert torch.allclose(layer(x), expected, atol=1e-6)


def test_merged_shards_in_any_order():
    layer = MergedColumnLinear(6, [5, 5], bias=False, method=UnquantizedLinearMethod(), dtype=torch.float32)
    gate, up = torch.randn(5, 6), torch.randn(5, 6)
    layer.weight.weight_loader(layer.weight, up, 1)  # checkpoints may list up before gate
    layer.weight.weight_loader(layer.weight, gate, 0)
    assert layer.weight.shard_ids == (0, 1)
    assert torch.equal(layer.weight[:5], gate) and torch.equal(layer.weight[5:], up)


def test_a_misshaped_shard_is_refused_with_both_shapes():
    layer = QKVLinear(8, q_size=12, kv_size=4, bias=False, method=UnquantizedLinearMethod(), dtype=torch.float32)
    layer.weight.data.zero_()
    with pytest.raises(WeightShapeError) as info:
        layer.weight.weight_loader(layer.weight, torch.ones(5, 8), "k")
    assert (info.value.got, info.value.expected) == ((5, 8), (4, 8))
    assert not layer.weight.any()  # nothing half-copied


@pytest.fixture(scope="module")
def llama_state(tiny_models):
    return ModelConfig.from_pretrained(tiny_models["llama"]), load_file(tiny_models["llama"] / "model.safetensors")


def build(config: ModelConfig) -> LlamaForCausalLM:
    return LlamaForCausalLM(config, 64, dtype=torch.float32, linear_method=UnquantizedLinearMethod())


@pytest.mark.parametrize("dropped, named", [("model.layers.1.mlp.up_proj.weight", "up_proj"),
                                            ("model.layers.0.self_attn.v_proj.weight", "v_proj"),
                                            ("model.layers.0.input_layernorm.weight", "input_layernorm")])
def test_the_loader_names_a_missing_shard(llama_state, dropped, named):
    config, state = llama_state
    loader = WeightLoader(build(config))
    for name, tensor in state.items():
        if name != dropped:
            loader.load(name, tensor)
    with pytest.raises(ModelLoadError, match="missing tensor") as info:
        loader.check_complete()
    assert repr(dropped) in str(info.value) and named in str(info.value)


def test_the_loader_fills_every_shard_of_a_complete_checkpoint(llama_state):
    config, state = llama_state
    model = build(config)
    loader = WeightLoader(model)
    for name, tensor in state.items():
        loader.load(name, tensor)
    loader.check_complete()
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    q, k, v = (state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(qkv, torch.cat([q, k, v]))


def test_the_loader_names_a_misshaped_tensor(llama_state):
    config, state = llama_state
    loader = WeightLoader(build(config))
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(3, 64\), "
                                             r"expected \(128, 64\)"):
        loader.load("model.layers.0.mlp.gate_proj.weight", torch.zeros(3, 64))


# ---- the CPU methods: the same products as F.linear -----------------------------------------------

def packed_and_plain(method: LinearMethod, dtype: torch.dtype):
    weights = {s: torch.randn(n, 64).to(dtype) for s, n in (("q", 48), ("k", 16), ("v", 16))}
    biases = {s: torch.randn(w.shape[0]).to(dtype) for s, w in weights.items()}
    layers = []
    for m in (method, UnquantizedLinearMethod()):
        layer = QKVLinear(64, 48, 16, bias=True, method=m, dtype=dtype)
        load_shards(layer, {"weight": weights, "bias": biases})
        layer.process_weights_after_loading()
        layers.append(layer)
    return layers


@pytest.mark.parametrize("rows", [1, 5])
def test_mkl_method_matches_f_linear(rows):
    if not isinstance(select_linear_method(torch.device("cpu"), torch.float32), MKLLinearMethod):
        pytest.skip("no MKL packed GEMM in this torch build")
    packed, plain = packed_and_plain(MKLLinearMethod(), torch.float32)
    x = torch.randn(rows, 64)
    assert torch.allclose(packed(x), plain(x), atol=1e-4)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_onednn_method_matches_f_linear(rows, native):
    if not isinstance(select_linear_method(torch.device("cpu"), torch.bfloat16), OneDNNLinearMethod):
        pytest.skip("no oneDNN bf16 on this CPU")
    kernels = load_cpu_kernels() if native else None
    if native and (kernels is None or not kernels.has_gemv):
        pytest.skip("no native GEMV here")
    method = OneDNNLinearMethod(batch_hint=16, kernels=kernels)
    assert (method.gemv is not None) == native
    packed, plain = packed_and_plain(method, torch.bfloat16)
    x = torch.randn(rows, 64).bfloat16()
    assert torch.allclose(packed(x).float(), plain(x).float(), rtol=2 ** -6, atol=0.1)


def test_cuda_and_other_dtypes_use_f_linear():
    assert type(select_linear_method(torch.device("cpu"), torch.float16)) is UnquantizedLinearMethod
    assert type(select_linear_method(torch.device("cuda"), torch.bfloat16)) is UnquantizedLinearMethod


# ---- a new method, defined here alone ------------------------------------------------------------

class TransposedLinearMethod(LinearMethod):
    """Stores the weight as [in, out] (fused shards side by side in columns) and applies x @ W."""

    def __init__(self):
        self.calls = 0

    def create_weights(self, layer, bias, dtype):
        weight = torch.empty(layer.in_features, layer.out_features, dtype=dtype)
        register_weight_and_bias(layer, weight, bias, self.weight_loader)

    def weight_loader(self, param, loaded, shard_id):
        start, size = param.output_offsets[shard_id]
        if param.dim() == 1:
            param.data[start:start + size].copy_(loaded)
        else:
            param.data[:, start:start + size].copy_(loaded.t())

    def apply(self, layer, x):
        self.calls += 1
        out = x @ layer.weight
        return out if layer.bias is None else out + layer.bias


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_new_method_in_one_class_runs_in_parity_with_transformers(tiny_models, arch, monkeypatch):
    from transformers import AutoModelForCausalLM

    from llmctl.engine.layers.quantization import base

    method = TransposedLinearMethod()
    monkeypatch.setattr(base, "select_linear_method", lambda *args, **kwargs: method)  # the unquantised choice
    folder = tiny_models[arch]
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=400,
              max_num_batched_tokens=96)
    model = llm.engine.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * model.config.num_layers + 1 and all(m.method is method for m in linears)
    assert model.lm_head.weight.shape == (model.config.hidden_size, model.config.vocab_size)  # stored transposed

    prompts = make_prompts(llm.engine.vocab_size)[:5]
    recorders = [LogitRecorder() for _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logits_processors=[r])
              for r in recorders]
    outputs = llm.generate(prompts, params)
    assert method.calls > 0
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, out, rec in zip(prompts, outputs, recorders):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                          do_sample=False)[0, len(prompt):]
        assert tokens == expected.tolist()
        diff = (torch.stack(rec.rows) - reference_logits(reference, prompt, tokens)).abs().max().item()
        assert diff < 1e-3


class TrackedTransposedLinearMethod(TransposedLinearMethod):
    def __init__(self):
        super().__init__()
        self.layers: list[weakref.ref] = []

    def create_weights(self, layer, bias, dtype):
        super().create_weights(layer, bias, dtype)
        self.layers.append(weakref.ref(layer))


def test_a_method_that_cannot_share_the_embedding_refuses_tied_checkpoints(tiny_models, monkeypatch):
    from llmctl.engine.layers.quantization import base

    method = TrackedTransposedLinearMethod()
    monkeypatch.setattr(base, "select_linear_method", lambda *args, **kwargs: method)
    with pytest.raises(ModelLoadError, match="TransposedLinearMethod cannot share the embedding") as info:
        LLM(str(tiny_models["qwen2"]), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=64)
    assert method.layers and info.value  # the error is still held, as a server logging it would
    gc.collect()
    assert all(ref() is None for ref in method.layers), "the half-built model outlives its ModelLoadError"


# ---- the interface holds the next methods: extra parameters with their own loaders, rank shards --------

class Int8LinearMethod(LinearMethod):
    """Weight-only int8, symmetric per output channel: `qweight` int8 [out, in] and `scales` [out], each
    loaded shard by shard from its own checkpoint tensor (`*.qweight`, `*.scales`)."""

    def create_weights(self, layer, bias, dtype):
        shards = dict(shard_ids=tuple(layer.output_offsets), output_offsets=layer.output_offsets)
        new_parameter(layer, "qweight", torch.empty(layer.out_features, layer.in_features, dtype=torch.int8),
                      self.weight_loader, **shards)
        new_parameter(layer, "scales", torch.empty(layer.out_features, dtype=dtype), self.weight_loader, **shards)
        layer.bias = None

    def weight_loader(self, param, loaded, shard_id):
        start, size = param.output_offsets[shard_id]
        copy_checked(param.data.narrow(0, start, size), loaded)

    def apply(self, layer, x):
        return F.linear(x, layer.qweight.to(x.dtype)) * layer.scales


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scales[:, None]).to(torch.int8), scales


def test_a_quantised_method_registers_its_own_parameters_and_the_loader_checks_them(llama_state):
    config, state = llama_state
    model = LlamaForCausalLM(config, 64, dtype=torch.float32, linear_method=Int8LinearMethod())
    loader = WeightLoader(model)
    quantised = {}
    for name, tensor in state.items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            base = name[: -len(".weight")]
            quantised[f"{base}.qweight"], quantised[f"{base}.scales"] = quantize(tensor)
        else:
            quantised[name] = tensor
    for name, tensor in quantised.items():
        if name != "model.layers.0.self_attn.k_proj.scales":
            loader.load(name, tensor)
    with pytest.raises(ModelLoadError, match="'model.layers.0.self_attn.k_proj.scales'"):
        loader.check_complete()
    loader.load("model.layers.0.self_attn.k_proj.scales", quantised["model.layers.0.self_attn.k_proj.scales"])
    loader.check_complete()
    qkv = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, config.hidden_size)
    full = torch.cat([state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert (qkv(x) - F.linear(x, full)).abs().max() < 0.02 * F.linear(x, full).abs().max()


class RankShardMethod(UnquantizedLinearMethod):
    """Tensor parallelism's weights for one rank of `world`: column layers keep 1/world of every output
    shard, row layers 1/world of the inputs; the loader narrows each full checkpoint tensor by rank."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def create_weights(self, layer, bias, dtype):
        row = isinstance(layer, RowLinear)
        offsets, start = {}, 0
        for shard_id, (_, size) in layer.output_offsets.items():
            part = size if row else size // self.world
            offsets[shard_id], start = (start, part), start + part
        in_features = layer.in_features // self.world if row else layer.in_features
        shards = dict(shard_ids=tuple(offsets), output_offsets=offsets, split_dim=1 if row else 0)
        new_parameter(layer, "weight", torch.empty(start, in_features, dtype=dtype), self.weight_loader, **shards)
        layer.bias = None

    def weight_loader(self, param, loaded, shard_id):
        dim = param.split_dim
        part = loaded.shape[dim] // self.world
        super().weight_loader(param, loaded.narrow(dim, self.rank * part, part), shard_id)


def test_a_rank_shard_method_narrows_each_loaded_tensor_by_rank():
    q, k, v = torch.randn(8, 6), torch.randn(4, 6), torch.randn(4, 6)
    down = torch.randn(6, 10)
    for rank in (0, 1):
        method = RankShardMethod(rank, world=2)
        qkv = QKVLinear(6, 8, 4, bias=False, method=method, dtype=torch.float32)
        for shard, tensor in zip("qkv", (q, k, v)):
            qkv.weight.weight_loader(qkv.weight, tensor, shard)
        halves = [t.chunk(2)[rank] for t in (q, k, v)]
        assert torch.equal(qkv.weight, torch.cat(halves))
        row = RowLinear(10, 6, bias=False, method=method, dtype=torch.float32)
        row.weight.weight_loader(row.weight, down, None)
        assert torch.equal(row.weight, down.chunk(2, dim=1)[rank])
