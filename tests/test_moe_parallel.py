"""Mixture-of-experts models with tensor parallel 2 on CPU (gloo): every expert's intermediate size split over the
ranks (vLLM's layout without expert parallelism; the router replicated; Qwen2-MoE's shared expert split like a
dense MLP), each MoE layer's partial sums all-reduced once. Greedy tokens equal TP=1's and transformers', logits
within float32 noise, for fused experts (Qwen2-MoE) and per-expert ones: int4-g32 on the fly and a Q8_0 GGUF
file (Qwen3-MoE)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_writer import write_gguf
from test_moe import MOE_CONFIGS, TINY, moe_models  # noqa: F401 - the tiny checkpoints fixture
from test_parity import make_prompts
from tp_helpers import greedy_run, run_ranks

from llmctl.engine.parallel import TensorParallel

NEW_TOKENS = 4
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", max_num_batched_tokens=32, max_num_seqs=4,
              max_model_len=256)
PROMPTS = make_prompts(256)[1:5]  # 7 to 64 tokens: chunked prefill beside decodes
# name -> (model, extra engine arguments); a Qwen3-MoE whose experts' 64 intermediate rows split in whole groups of
# 32, so each rank holds TP=1's codes (int4-g32 quantised per rank; Q8_0 blocks narrowed from the file's)
RUNS = {"qwen2_moe": ("qwen2_moe", {}), "qwen3_moe-int4-g32": ("qwen3_moe_wide", {"quantization": "int4-g32"}),
        "qwen3_moe-gguf-Q8_0": ("qwen3_moe_wide.gguf", {})}


def _generate(tp: TensorParallel, folders: dict[str, str]):
    torch.manual_seed(0)
    return {name: greedy_run(folders[model], tp, PROMPTS, NEW_TOKENS, **ENGINE, **extra)
            for name, (model, extra) in RUNS.items()}


@pytest.fixture(scope="module")
def tp_runs(moe_models, tmp_path_factory):
    import transformers

    config_name, extra = MOE_CONFIGS["qwen3_moe"]
    config = getattr(transformers, config_name)(**TINY, **{**extra, "moe_intermediate_size": 64})
    torch.manual_seed(5)
    wide = tmp_path_factory.mktemp("moe-tp") / "qwen3_moe_wide"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(wide)
    write_gguf(wide, wide.parent / "qwen3_moe_wide.gguf", {}, default_type="Q8_0")
    folders = {**{arch: str(folder) for arch, folder in moe_models.items()}, "qwen3_moe_wide": str(wide),
               "qwen3_moe_wide.gguf": str(wide.parent / "qwen3_moe_wide.gguf")}
    single = _generate(TensorParallel.single(), folders)
    sharded = run_ranks(_generate, 2, folders, timeout=300)
    return folders, single, sharded


@pytest.mark.parametrize("name", list(RUNS))
def test_tp2_greedy_matches_tp1(tp_runs, name):
    _, single, sharded = tp_runs
    one, rank0, rank1 = single[name], sharded[0][name], sharded[1][name]
    assert rank0["heads"] == rank1["heads"] == (one["heads"][0] // 2, one["heads"][1] // 2)
    assert rank0["tokens"] == rank1["tokens"] == one["tokens"]
    for ours, theirs in zip(rank0["logits"], one["logits"]):
        assert np.abs(ours - theirs).max() < 1e-3


def test_tp2_greedy_matches_transformers(tp_runs, name="qwen2_moe"):
    """Qwen2-MoE: a shared expert, its gate and a dense layer beside the experts (TP=1 is checked against
    transformers for every architecture in test_moe.py)."""
    from transformers import AutoModelForCausalLM

    folders, _, sharded = tp_runs
    reference = AutoModelForCausalLM.from_pretrained(folders[RUNS[name][0]], dtype=torch.float32).eval()
    for prompt, tokens in zip(PROMPTS, sharded[0][name]["tokens"]):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                          min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        assert tokens == expected.tolist(), f"{name}: a {len(prompt)}-token prompt diverged from transformers"


def test_an_intermediate_size_that_does_not_split_is_refused(moe_models):
    """Mixtral's 96 experts' rows split over 2 ranks, but not 5: refused naming the dimension."""
    from llmctl.engine.layers.fused_moe import FusedMoE
    from llmctl.engine.layers.linear import LinearFactory, UnquantizedLinearMethod
    from llmctl.engine.parallel import TensorParallelError

    linears = LinearFactory(UnquantizedLinearMethod(), torch.float32, TensorParallel(1, 5))
    with pytest.raises(TensorParallelError, match=r"the experts' intermediate size \(96\) is not divisible by the "
                                                  r"tensor-parallel size \(5\)"):
        FusedMoE(6, 2, 64, 96, True, linears, torch.nn.functional.silu)
