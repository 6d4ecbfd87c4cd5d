"""Expert parallelism (issue 43, --enable-expert-parallel): with N tensor-parallel ranks each holds num_experts / N
whole experts, every rank routes every token and runs the pairs whose expert it holds, the partial sums are
all-reduced; attention, dense MLPs and Qwen2-MoE's shared expert stay tensor-parallel. One rank's pieces
(placement, loading, partial sums) without processes; then EP=2 over gloo giving TP=1's and transformers'
greedy tokens through chunked prefill, preemption and prefix hits; a count the ranks do not divide refused."""

from __future__ import annotations

import logging

import pytest
import torch

from test_moe import moe_models  # noqa: F401 - the tiny Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints
from test_parity import LogitRecorder

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import EngineArgsError, ModelLoadError
from llmctl.engine.layers.linear import UnquantizedLinearMethod
from llmctl.engine.parallel import TensorParallel, TensorParallelError, expert_ranges

F32 = torch.float32


def test_experts_are_dealt_out_whole_in_contiguous_blocks():
    assert expert_ranges(8, 2) == [range(0, 4), range(4, 8)]
    assert expert_ranges(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert TensorParallel(1, 2, expert_parallel=True).expert_range(6) == range(3, 6)
    assert TensorParallel(1, 2).expert_range(6) == range(0, 6)  # without expert parallelism: all of them
    with pytest.raises(TensorParallelError, match="6 experts are not divisible by the expert-parallel size .4"):
        expert_ranges(6, 4)


def _build(folder, tp: TensorParallel):
    from llmctl.engine.loader import build_model
    from llmctl.engine.model_config import ModelConfig

    return build_model(ModelConfig.from_pretrained(folder), folder, max_positions=64, dtype=F32,
                       device=torch.device("cpu"), load_format="auto", seed=0, linear_method=UnquantizedLinearMethod(),
                       tp=tp)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_each_rank_loads_its_experts_and_the_partial_sums_add_up_to_one_ranks(moe_models, arch):
    """Both ranks of EP=2 built without processes (loading needs no collective): each holds its half of TP=1's
    expert weights, and the two ranks' expert outputs (before the all-reduce) sum to TP=1's."""
    whole = _build(moe_models[arch], TensorParallel.single()).model.layers[0].mlp
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    logits = whole.gate(hidden)
    partial = []
    for rank in range(2):
        block = _build(moe_models[arch], TensorParallel(rank, 2, expert_parallel=True)).model.layers[0].mlp
        held = expert_ranges(whole.experts.num_experts, 2)[rank]
        assert block.experts.experts == held
        assert torch.equal(block.experts.w13_weight, whole.experts.w13_weight[held.start:held.stop])
        assert torch.equal(block.experts.w2_weight, whole.experts.w2_weight[held.start:held.stop])
        partial.append(block.experts(hidden, logits))
    assert partial[0].abs().sum() > 0 and partial[1].abs().sum() > 0  # each rank ran some pairs
    torch.testing.assert_close(partial[0] + partial[1], whole.experts(hidden, logits))


def test_without_expert_parallelism_every_rank_holds_a_slice_of_every_expert(moe_models):
    whole = _build(moe_models["qwen3_moe"], TensorParallel.single()).model.layers[0].mlp.experts
    sliced = _build(moe_models["qwen3_moe"], TensorParallel(1, 2)).model.layers[0].mlp.experts
    assert sliced.experts == whole.experts and sliced.w2_weight.shape[2] * 2 == whole.w2_weight.shape[2]
    half = whole.w2_weight.shape[2] // 2
    assert torch.equal(sliced.w2_weight, whole.w2_weight[:, :, half:])


def test_an_expert_count_the_ranks_do_not_divide_is_refused_before_any_rank_starts(moe_models):
    with pytest.raises(EngineArgsError, match="6 experts are not divisible by the expert-parallel size .4"):
        LLM(str(moe_models["mixtral"]), skip_tokenizer_init=True, device="cpu", tensor_parallel_size=4,
            enable_expert_parallel=True)


def _greedy(llm: LLM, prompts, new_tokens: int):
    recorders = [LogitRecorder() for _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logits_processors=[rec])
              for rec in recorders]
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    return tokens, [torch.stack(rec.rows) for rec in recorders], llm.engine.get_stats()


def test_ep2_over_gloo_gives_tp1_and_transformers_greedy_tokens(moe_models, caplog):
    """Qwen2-MoE (8 experts, a shared expert, a dense layer) on two ranks: 4 experts each, the start-up log
    naming them; a 32-token budget chunks the long prompts beside decodes, 10 blocks force preemptions, the
    shared 40-token prefix hits the prefix cache. Tokens equal TP=1's and transformers', logits within 1e-4;
    seeded samples equal TP=1's."""
    from transformers import AutoModelForCausalLM

    folder = moe_models["qwen2_moe"]
    shared = [(7 * i) % 256 for i in range(40)]
    prompts = [shared + [1, 2, 3], [9, 8, 7], shared + [4, 5], list(range(60, 110)), [200, 17]]
    settings = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=128, block_size=16,
                    max_num_batched_tokens=32, num_kv_blocks=10, max_num_seqs=5, enable_prefix_caching=True)
    seeded = SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True)
    with LLM(str(folder), **settings) as one:
        want, want_logits, _ = _greedy(one, prompts, 12)
        want_seeded = [out.outputs[0].token_ids for out in one.generate(prompts[:2], seeded)]
    with caplog.at_level(logging.INFO, logger="llmctl.engine.llm_engine"):
        with LLM(str(folder), tensor_parallel_size=2, enable_expert_parallel=True, **settings) as ep:
            assert ep.engine.model_info.expert_placement == ((0, 1, 2, 3), (4, 5, 6, 7))
            assert ep.engine.executor.runner.model.model.layers[0].mlp.experts.w13_weight.shape[0] == 4
            got, got_logits, stats = _greedy(ep, prompts, 12)
            got_seeded = [out.outputs[0].token_ids for out in ep.generate(prompts[:2], seeded)]
    assert "expert parallel: experts: rank 0 holds 0-3, rank 1 holds 4-7" in caplog.text
    assert got_seeded == want_seeded  # seeded sampling too: rank 0 samples from the same logits
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    assert got == want
    assert max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits)) < 1e-4
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=F32).eval()
    for prompt, tokens in zip(prompts, got):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                      do_sample=False)[0, len(prompt):]
        assert tokens == expected.tolist(), f"a {len(prompt)}-token prompt diverged from transformers"


def test_the_placement_is_in_generate_json_and_serve_start_up_line():
    from llmctl.engine.llm_engine import ModelInfo
    from llmctl.generate_runner import _memory
    from llmctl.server.runner import memory_line

    info = ModelInfo(model="m", max_model_len=64, vocab_size=256, tokenizer=None, eos_token_ids=frozenset(),
                     bos_token_id=None, dtype="float32", quantization=None, weight_bytes=1, kv_cache_bytes=1,
                     expert_placement=((0, 1, 2), (3, 4, 5)))
    assert _memory(info)["expert_placement"] == [[0, 1, 2], [3, 4, 5]]
    assert memory_line(info).endswith("; experts: rank 0 holds 0-2, rank 1 holds 3-5")
    one_rank = ModelInfo(**{**info.__dict__, "expert_placement": ()})
    assert "expert_placement" not in _memory(one_rank) and "experts" not in memory_line(one_rank)
