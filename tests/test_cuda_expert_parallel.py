"""Expert parallelism on CUDA with NCCL, one GPU per rank (scripts/gpu_check.sh's `ep_nccl` step; skipped with
fewer than two GPUs): a tiny Qwen2-MoE (8 experts, a shared expert, a dense layer) at EP=2, each rank holding 4
experts and running them with the Triton grouped GEMM (the other rank's pairs skipped), gives the greedy tokens
of one GPU holding all experts, under chunked prefill, preemption and prefix caching."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from llmctl.engine.parallel import TensorParallel
from test_cuda_tensor_parallel import ENGINE, NEW_TOKENS
from test_parity import make_prompts
from tp_helpers import greedy_run, run_ranks

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason=f"EP=2 over NCCL needs two GPUs, this host has {torch.cuda.device_count()}")]

def _tiny_qwen2_moe(folder) -> str:
    import transformers

    from test_moe import MOE_CONFIGS, TINY

    config_name, extra = MOE_CONFIGS["qwen2_moe"]
    config = getattr(transformers, config_name)(**{**TINY, "vocab_size": 512}, **extra)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


def _on_this_ranks_gpu(tp: TensorParallel, folder: str):
    if not tp.is_single:
        tp = dataclasses.replace(tp, expert_parallel=True)
    return greedy_run(folder, tp, make_prompts(512), NEW_TOKENS, device=f"cuda:{tp.rank}", **ENGINE)


def test_ep2_over_nccl_matches_one_gpu(tmp_path):
    folder = _tiny_qwen2_moe(tmp_path / "qwen2-moe")
    single = _on_this_ranks_gpu(TensorParallel.single(), folder)
    rank0, rank1 = run_ranks(_on_this_ranks_gpu, 2, folder, timeout=300, backend="nccl")
    assert rank0["preemptions"] > 0 and rank0["prefix_hits"] > 0
    assert rank0["tokens"] == rank1["tokens"] == single["tokens"]
    for ours, theirs in zip(rank0["logits"], single["logits"]):
        assert np.abs(ours - theirs).max() < 1e-3  # NCCL sums the experts' partial outputs in another order


def test_two_replicas_deal_the_experts_over_two_gpus_and_answer_as_one_gpu(tmp_path):
    """-dp 2 --enable-expert-parallel: replica d on cuda:d holds experts 4d..4d+3, the tokens gathered and the sums
    scattered over a stateless NCCL group (the counts over gloo); the replicas' greedy and seeded tokens are one
    GPU's, with one replica idle for a lone request."""
    from test_expert_data_parallel import ENGINE as CPU_ENGINE, PROMPTS, _answers, _params, _start

    from llmctl.engine import LLM, EngineArgs
    from llmctl.server.replicas import load_replicas

    folder = _tiny_qwen2_moe(tmp_path / "qwen2-moe")
    engine = {**CPU_ENGINE, "device": "cuda", "enforce_eager": True}
    with LLM(folder, **engine) as one:
        expected = [out.outputs[0].token_ids for out in one.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])]
    replicas = load_replicas(EngineArgs(model=folder, data_parallel_size=2, enable_expert_parallel=True, **engine))
    try:
        _start(replicas)
        assert [r.engine.executor.device.index for r in replicas] == [0, 1]
        assert _answers(replicas, PROMPTS) == expected
        assert _answers(replicas[:1], PROMPTS[:1]) == expected[:1]
    finally:
        for replica in replicas:
            replica.shutdown()
