"""Data parallelism x tensor parallelism on CUDA (scripts/gpu_check.sh's `dp_tp_nccl` step; skipped with fewer
than four GPUs): `-dp 2 -tp 2`, replica d's ranks on GPUs 2d and 2d + 1 with their collectives over NCCL and
the server's process driving cuda:0 and cuda:2, answers greedy and seeded requests as one engine on cuda:0."""

from __future__ import annotations

import pytest
import torch

from test_server_data_parallel import check_two_tensor_parallel_replicas

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 4,
                                 reason=f"-dp 2 -tp 2 needs four GPUs, this host has {torch.cuda.device_count()}")]


def test_two_replicas_of_two_gpus_each_answer_as_one_gpu(tiny_chat_model):
    check_two_tensor_parallel_replicas(tiny_chat_model, {"device": "cuda", "dtype": "float32", "num_kv_blocks": 64,
                                                         "max_num_seqs": 4, "enforce_eager": True})
