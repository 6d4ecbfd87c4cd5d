"""Tensor parallelism, model side (issue 17): each linear's shard loading, and TP=2 over gloo giving the
greedy tokens (and logits) of TP=1 and of transformers for every architecture, under chunked prefill,
preemption and prefix caching (one engine per rank: tests/tp_helpers.py's greedy_run)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_model
from llmctl.engine.layers.embedding import VocabParallelEmbedding
from llmctl.engine.layers.linear import (
    ColumnLinear,
    MergedColumnLinear,
    QKVLinear,
    RowLinear,
    UnquantizedLinearMethod,
    rank_columns,
    rank_rows,
)
from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.quantization import quantized_linear_method
from llmctl.engine.layers.quantization.grouped import GroupedIntWeight, rank_grouped_part
from llmctl.engine.parallel import TensorParallel, TensorParallelError
from tp_helpers import greedy_run, run_ranks

PLAIN = UnquantizedLinearMethod()
F32 = torch.float32


def ranks(size: int = 2) -> list[TensorParallel]:
    return [TensorParallel(rank, size) for rank in range(size)]  # no group: loading needs no collective


def load(layer, name: str, tensor: torch.Tensor, shard=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard)


# ---- shard loading, one rank at a time ------------------------------------------------------------

def test_qkv_shards_keep_each_ranks_heads():
    head_dim, hidden = 2, 6
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (4, 2, 2))
    for tp in ranks():
        layer = QKVLinear(hidden, 8, 4, False, PLAIN, F32, tp, head_dim=head_dim)
        for shard, tensor in zip("qkv", (q, k, v)):
            load(layer, "weight", tensor, shard)
        r = tp.rank
        expected = torch.cat([q[4 * r: 4 * r + 4], k[2 * r: 2 * r + 2], v[2 * r: 2 * r + 2]])
        assert layer.out_features == 8 and torch.equal(layer.weight, expected)


def test_one_kv_head_is_replicated_on_every_rank():
    q, k, v = torch.randn(8, 6), torch.randn(2, 6), torch.randn(2, 6)
    for tp in ranks():
        layer = QKVLinear(6, 8, 2, True, PLAIN, F32, tp, head_dim=2)
        for shard, tensor in zip("qkv", (q, k, v)):
            load(layer, "weight", tensor, shard)
            load(layer, "bias", tensor[:, 0], shard)
        assert torch.equal(layer.weight, torch.cat([q[4 * tp.rank: 4 * tp.rank + 4], k, v]))
        assert torch.equal(layer.bias, torch.cat([q[4 * tp.rank: 4 * tp.rank + 4, 0], k[:, 0], v[:, 0]]))


def test_merged_gate_up_split_each_shard():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    for tp in ranks():
        layer = MergedColumnLinear(4, [6, 6], False, PLAIN, F32, tp)
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
        r = tp.rank
        assert torch.equal(layer.weight, torch.cat([gate[3 * r: 3 * r + 3], up[3 * r: 3 * r + 3]]))


def test_row_shards_sum_to_the_full_product_with_the_bias_once():
    weight, bias, x = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    partial = []
    for tp in ranks():
        layer = RowLinear(8, 5, True, PLAIN, F32, tp)
        load(layer, "weight", weight)
        load(layer, "bias", bias)
        assert layer.in_features == 4 and torch.equal(layer.weight, weight[:, 4 * tp.rank: 4 * tp.rank + 4])
        partial.append(layer.method.apply(layer, x[:, 4 * tp.rank: 4 * tp.rank + 4]))  # before the all-reduce
    torch.testing.assert_close(partial[0] + partial[1], F.linear(x, weight, bias))


def test_vocab_parallel_lm_head_and_embedding_pad_the_last_part_with_zeros():
    table = torch.randn(5, 4)
    heads, embeds = [], []
    for tp in ranks():
        head = ColumnLinear(4, 5, False, PLAIN, F32, tp, padded=True)
        embed = VocabParallelEmbedding(5, 4, F32, tp)
        load(head, "weight", table)
        load(embed, "weight", table)
        heads.append(head.weight.clone())
        embeds.append(embed.weight.clone())
    assert [h.shape[0] for h in heads] == [3, 3]
    torch.testing.assert_close(torch.cat(heads), torch.cat([table, torch.zeros(1, 4)]))
    torch.testing.assert_close(torch.cat(embeds), torch.cat(heads))


def test_a_checkpoint_tensor_of_the_wrong_shape_is_named_with_its_full_shape():
    layer = QKVLinear(6, 8, 4, False, PLAIN, F32, TensorParallel(1, 2), head_dim=2)
    param = layer.weight
    with pytest.raises(ValueError, match=r"shape \(6, 6\), expected \(8, 6\)"):
        param.weight_loader(param, torch.randn(6, 6), "q")


def test_sizes_that_do_not_split_are_refused():
    with pytest.raises(TensorParallelError, match=r"intermediate size\) \(6\) is not divisible .* \(4\)"):
        MergedColumnLinear(4, [6, 6], False, PLAIN, F32, TensorParallel(0, 4))
    with pytest.raises(TensorParallelError, match="attention heads"):
        QKVLinear(6, 6, 2, False, PLAIN, F32, TensorParallel(0, 2), head_dim=2)


def test_a_method_whose_loaders_take_whole_tensors_is_refused_with_several_ranks():
    from llmctl.engine.errors import ModelLoadError
    from llmctl.engine.layers.linear import LinearMethod

    class WholeTensorMethod(LinearMethod):
        def create_weights(self, layer, bias, dtype):
            raise AssertionError("not reached")

    with pytest.raises(ModelLoadError, match="WholeTensorMethod cannot be split over tensor-parallel ranks"):
        ColumnLinear(4, 4, False, WholeTensorMethod(), F32, TensorParallel(0, 2))


@pytest.mark.parametrize("quantization", ["int8", "int4-g32", "int4-g32-asym"])
def test_quantised_shards_quantise_their_own_part(quantization):
    """--quantization with several ranks: each rank quantises its column part / row part after loading, and
    the shards together compute the full product within the quantisation error."""
    torch.manual_seed(0)
    column_weight, row_weight, x = torch.randn(32, 64), torch.randn(16, 64), torch.randn(3, 64)
    columns, partial = [], []
    for tp in ranks():
        method = quantized_linear_method(quantization, torch.device("cpu"), F32)
        column = ColumnLinear(64, 32, False, method, F32, tp)
        row = RowLinear(64, 16, False, method, F32, tp)
        load(column, "weight", column_weight)
        load(row, "weight", row_weight)
        column.process_weights_after_loading()
        row.process_weights_after_loading()
        assert (column.out_features, row.in_features) == (16, 32)
        columns.append(column(x))
        partial.append(row.method.apply(row, x[:, 32 * tp.rank: 32 * tp.rank + 32]))  # before the all-reduce
    for got, expected in ((torch.cat(columns, dim=-1), F.linear(x, column_weight)),
                          (partial[0] + partial[1], F.linear(x, row_weight))):
        error = (got - expected).norm() / expected.norm()
        assert error < (0.02 if quantization == "int8" else 0.15), f"relative error {error:.3f}"


def act_order(in_features: int, group_size: int, blocks: int, seed: int = 0) -> torch.Tensor:
    """A GPTQ-style input order (column j holds input perm[j]) drawn within each of `blocks` input blocks."""
    generator = torch.Generator().manual_seed(seed)
    width = in_features // blocks
    return torch.cat([block * width + torch.randperm(width, generator=generator) for block in range(blocks)])


def full_grouped(out_features: int, in_features: int, group_size: int, perm=None) -> GroupedIntWeight:
    torch.manual_seed(0)
    weight = GroupedIntWeight.quantize(torch.randn(out_features, in_features), 4, group_size, symmetric=False)
    return GroupedIntWeight(weight.codes, weight.scales, weight.zeros, 4, group_size, perm)


# layer -> (builder, whole checkpoint [out, in], group size, act-order blocks or None)
NARROWED = {
    "qkv": (lambda tp: QKVLinear(64, 32, 16, False, PLAIN, F32, tp, head_dim=8), (64, 64), 16, 1),
    "gate_up": (lambda tp: MergedColumnLinear(64, [32, 32], False, PLAIN, F32, tp), (64, 64), 32, None),
    "lm_head-padded": (lambda tp: ColumnLinear(64, 35, False, PLAIN, F32, tp, padded=True), (35, 64), 32, None),
    "row": (lambda tp: RowLinear(64, 16, False, PLAIN, F32, tp), (16, 64), 16, None),
    "row-act-order": (lambda tp: RowLinear(64, 16, False, PLAIN, F32, tp), (16, 64), 16, 2),
    "row-per-channel": (lambda tp: RowLinear(64, 16, False, PLAIN, F32, tp), (16, 64), 64, 1),
}


@pytest.mark.parametrize("name", sorted(NARROWED))
def test_a_grouped_weights_rank_part_dequantises_to_the_full_weights_part(name):
    """Pre-quantised checkpoints: the whole checkpoint's GroupedIntWeight narrowed to a rank (output rows per
    fused shard, a row-parallel layer's input columns, act-order permutation and all) dequantises to that
    rank's part of the full dequantised weight, the part the unquantised method loads."""
    build, shape, group, blocks = NARROWED[name]
    perm = None if blocks is None else act_order(shape[1], group, blocks)
    full = full_grouped(*shape, group, perm)
    for tp in ranks():
        layer = build(tp)
        part = rank_grouped_part(layer, full, "test")
        assert (part.out_features, part.in_features) == (layer.out_features, layer.in_features)
        expected = rank_columns(layer, rank_rows(layer, full.dequantize()))
        torch.testing.assert_close(part.dequantize(), expected, rtol=0, atol=0)


def test_a_grouped_weight_whose_groups_straddle_two_ranks_is_refused():
    with pytest.raises(ModelLoadError, match=r"GPTQLinearMethod: a row-parallel linear's 48 inputs per .* group "
                                             r"size 32 \(a group would straddle two ranks\)"):
        rank_grouped_part(RowLinear(96, 16, False, PLAIN, F32, TensorParallel(0, 2)),
                          full_grouped(16, 96, 32), "GPTQLinearMethod")
    scattered = full_grouped(16, 64, 16, act_order(64, 16, blocks=1))  # one order over all the inputs
    with pytest.raises(ModelLoadError, match="GPTQLinearMethod: act-order .* hold inputs of two tensor-parallel ranks"):
        rank_grouped_part(RowLinear(64, 16, False, PLAIN, F32, TensorParallel(1, 2)), scattered, "GPTQLinearMethod")


def test_a_whole_model_loads_into_two_shards(tiny_models):
    """The loader's name mapping fills every shard's parameters on both ranks (nothing left missing)."""
    from llmctl.engine.loader import build_model
    from llmctl.engine.model_config import ModelConfig

    folder = tiny_models["qwen2"]
    config = ModelConfig.from_pretrained(folder)
    for tp in ranks():
        model = build_model(config, folder, max_positions=64, dtype=F32, device=torch.device("cpu"),
                            load_format="auto", seed=0, linear_method=PLAIN, tp=tp)
        attention = model.model.layers[0].self_attn
        assert (attention.num_heads, attention.num_kv_heads) == (2, 1)
        assert model.model.embed_tokens.weight.shape == (256, 64)
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied to this rank's part


# ---- TP=2 on gloo against TP=1 and transformers ---------------------------------------------------

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "llama-1kv"]
NEW_TOKENS = 8
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", max_num_batched_tokens=96, num_kv_blocks=40,
              block_size=16, max_num_seqs=8, max_model_len=400)


def tp_prompts(vocab: int) -> list[list[int]]:
    from test_parity import make_prompts

    return make_prompts(vocab)


# Runs besides the architectures' plain ones: name -> (model, extra engine arguments).
QUANTISED_RUNS = {"llama-int4-g32": ("llama", {"quantization": "int4-g32"})}
# Pre-quantised checkpoints of the llama model (qwen2 for a q/k/v bias), written by the tests' packers.
# desc_act: act-order within each half of the inputs, so the row-parallel o/down_proj keep whole groups.
CHECKPOINT_SCHEMES = {"gptq-4bit-g32": ("llama", dict(method="gptq")),
                      "gptq-4bit-g16-asym-act-order": ("qwen2", dict(method="gptq", group_size=16, sym=False,
                                                                     desc_act=True, order_blocks=2)),
                      "awq-g32": ("llama", dict(method="awq"))}
# GGUF: name -> (default type, types by tensor suffix); F16 (like Q6_K) runs dequantised, narrowed like a plain weight
GGUF_FILES = {"gguf-Q8_0": ("Q8_0", {}), "gguf-Q4_0-F16": ("Q4_0", {"attn_v.weight": "F16", "ffn_down.weight": "F16"})}
COMPRESSED = {"compressed-w4a16-g32-asym": dict(bits=4, symmetric=False, strategy="group", group_size=32)}
PRE_QUANTISED = [*CHECKPOINT_SCHEMES, *GGUF_FILES, *COMPRESSED]


def _generate_every_model(tp: TensorParallel, folders: dict[str, str]):
    runs = {name: (folder, {}) for name, folder in folders.items()}
    runs.update({name: (folders[arch], extra) for name, (arch, extra) in QUANTISED_RUNS.items()})
    return {name: greedy_run(folder, tp, tp_prompts(512), NEW_TOKENS, **ENGINE, **extra)
            for name, (folder, extra) in runs.items()}


def write_pre_quantised(tiny_models, root) -> dict[str, str]:
    from gguf_writer import write_gguf
    from test_compressed_tensors import compress_with_library
    from test_gptq_awq import Scheme, write_quantised_checkpoint

    written = {name: root / name for name in PRE_QUANTISED}
    for name, (arch, scheme) in CHECKPOINT_SCHEMES.items():
        write_quantised_checkpoint(tiny_models[arch], written[name], Scheme(**scheme))
    for name, (default_type, types) in GGUF_FILES.items():
        written[name] = root / f"{name}.gguf"
        write_gguf(tiny_models["llama"], written[name], types, default_type=default_type)
    for name, scheme in COMPRESSED.items():
        compress_with_library(tiny_models["llama"], written[name], **scheme)
    return {name: str(path) for name, path in written.items()}


@pytest.fixture(scope="module")
def tp_runs(tiny_models, tmp_path_factory):
    folders = {arch: str(tiny_models[arch]) for arch in ARCHS if arch in tiny_models}
    folders["llama-1kv"] = str(make_tiny_model(tmp_path_factory.mktemp("tp") / "llama-1kv", "llama",
                                               num_key_value_heads=1))
    folders.update(write_pre_quantised(tiny_models, tmp_path_factory.mktemp("tp-quantised")))
    single = _generate_every_model(TensorParallel.single(), folders)
    sharded = run_ranks(_generate_every_model, 2, folders, timeout=300)
    return folders, single, sharded


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_greedy_matches_tp1_and_transformers(tp_runs, arch):
    from transformers import AutoModelForCausalLM

    folders, single, sharded = tp_runs
    one, (rank0, rank1) = single[arch], (sharded[0][arch], sharded[1][arch])
    assert rank0["preemptions"] > 0 and rank0["prefix_hits"] > 0  # the batching machinery ran
    assert rank0["free_blocks"] and rank1["free_blocks"]
    heads, kv_heads = one["heads"]
    expected_kv = max(kv_heads // 2, 1)
    assert rank0["heads"] == rank1["heads"] == (heads // 2, expected_kv)
    assert rank0["kv_bytes_per_block"] * kv_heads == one["kv_bytes_per_block"] * expected_kv
    assert rank0["tokens"] == rank1["tokens"] == one["tokens"]
    for ours, theirs in zip(rank0["logits"], one["logits"]):
        assert np.abs(ours - theirs).max() < 1e-4
    reference = AutoModelForCausalLM.from_pretrained(folders[arch], dtype=torch.float32).eval()
    for prompt, tokens in zip(tp_prompts(512), rank0["tokens"]):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      do_sample=False)[0, len(prompt):]
        assert tokens == expected.tolist(), f"a {len(prompt)}-token prompt diverged from transformers"


def test_tp2_int4_matches_tp1_int4(tp_runs):
    """--quantization int4-g32 with 2 ranks: each rank quantises its own part, and with groups of 32 that never
    straddle a shard boundary the codes and scales are TP=1's, so the greedy tokens are too."""
    _, single, sharded = tp_runs
    one, (rank0, rank1) = single["llama-int4-g32"], (sharded[0]["llama-int4-g32"], sharded[1]["llama-int4-g32"])
    assert rank0["tokens"] == rank1["tokens"] == one["tokens"]
    plain = single["llama"]["logits"]
    assert max(np.abs(q - f).max() for q, f in zip(one["logits"], plain)) > 1e-2  # int4 really ran
    for ours, theirs in zip(rank0["logits"], one["logits"]):
        assert np.abs(ours - theirs).max() < 1e-3


@pytest.mark.parametrize("name", PRE_QUANTISED)
def test_tp2_pre_quantised_checkpoint_matches_tp1(tp_runs, name):
    """GPTQ (with and without act-order), AWQ, GGUF (Q8_0; Q4_0 with F16 dequantised) and compressed-tensors
    with 2 ranks: each rank unpacks the whole packed tensors and keeps its rows / input columns, whose groups
    stay whole, so each rank computes with TP=1's codes and scales and the greedy tokens are TP=1's."""
    _, single, sharded = tp_runs
    one, (rank0, rank1) = single[name], (sharded[0][name], sharded[1][name])
    assert rank0["tokens"] == rank1["tokens"] == one["tokens"]
    arch = CHECKPOINT_SCHEMES[name][0] if name in CHECKPOINT_SCHEMES else "llama"
    assert max(np.abs(q - f).max() for q, f in zip(one["logits"], single[arch]["logits"])) > 1e-3  # quantised
    for ours, theirs in zip(rank0["logits"], one["logits"]):
        assert np.abs(ours - theirs).max() < 1e-3
