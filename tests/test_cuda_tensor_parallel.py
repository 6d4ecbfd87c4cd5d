"""Tensor parallelism on CUDA with NCCL, one GPU per rank (scripts/gpu_check.sh's `tp_nccl` step; skipped
with fewer than two GPUs): TP=2 greedy tokens equal TP=1's on cuda:0 and logits agree, for a GQA model and
one with a single KV head (replicated on both ranks), under chunked prefill, preemption and prefix caching; with the
default graphs, and full decode graphs on the Triton backend (the collectives captured inside them). An engine of
two GPUs with async scheduling (rank 0's sampled ids broadcast over NCCL) gives its serial tokens and log-probs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_tiny_model
from llmctl.engine.parallel import TensorParallel
from test_multiproc_executor import check_tp2_async_scheduling
from test_parity import make_prompts
from tp_helpers import greedy_run, run_ranks

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason=f"TP=2 over NCCL needs two GPUs, this host has {torch.cuda.device_count()}")]

NEW_TOKENS = 8
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", max_num_batched_tokens=96, num_kv_blocks=40, block_size=16,
              max_num_seqs=8, max_model_len=400)


def _on_this_ranks_gpu(tp: TensorParallel, folders: dict[str, str], graphs: dict):
    return {name: greedy_run(folder, tp, make_prompts(512), NEW_TOKENS, device=f"cuda:{tp.rank}", **ENGINE, **graphs)
            for name, folder in folders.items()}


# Full decode graphs capture the NCCL all-reduces and all-gather inside them on each rank.
@pytest.mark.parametrize("graphs", [{}, {"attention_backend": "triton", "cudagraph_mode": "full_decode_only"}],
                         ids=["default", "full-graphs"])
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_tp2_over_nccl_matches_tp1(tmp_path, kv_heads, graphs):
    folder = str(make_tiny_model(tmp_path / "llama", "llama", num_key_value_heads=kv_heads))
    single = _on_this_ranks_gpu(TensorParallel.single(), {"llama": folder}, graphs)["llama"]
    rank0, rank1 = (result["llama"] for result in run_ranks(_on_this_ranks_gpu, 2, {"llama": folder}, graphs,
                                                            timeout=300, backend="nccl"))
    assert rank0["preemptions"] > 0 and rank0["prefix_hits"] > 0
    assert rank0["heads"] == rank1["heads"] == (2, max(kv_heads // 2, 1))
    assert rank0["tokens"] == rank1["tokens"] == single["tokens"]
    for ours, theirs in zip(rank0["logits"], single["logits"]):
        assert np.abs(ours - theirs).max() < 1e-3  # NCCL sums in another order than one GPU's GEMM


def test_tp2_async_scheduling_over_nccl_gives_the_serial_engines_tokens(tiny_chat_model):
    check_tp2_async_scheduling(tiny_chat_model, device="cuda")
