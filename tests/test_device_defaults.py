"""Batch limits resolved per device: vLLM's GPU defaults on CUDA, the CPU's unchanged, the user's values kept."""

from __future__ import annotations

import pytest

from llmctl.engine.args import EngineArgs
from llmctl.engine.errors import EngineArgsError


def limits(args: EngineArgs) -> tuple[int, int]:
    return args.max_num_seqs, args.max_num_batched_tokens


def test_cuda_gets_gpu_sized_batches():
    assert limits(EngineArgs().with_device_defaults("cuda")) == (256, 8192)


def test_cpu_defaults_are_unchanged():
    assert limits(EngineArgs().with_device_defaults("cpu")) == (128, 2048)
    assert limits(EngineArgs(block_size=4096).with_device_defaults("cpu")) == (128, 4096)  # at least one block


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_explicit_limits_win(device_type):
    args = EngineArgs(max_num_seqs=8, max_num_batched_tokens=512)
    assert limits(args.with_device_defaults(device_type)) == (8, 512)
    assert limits(EngineArgs(max_num_seqs=300).with_device_defaults(device_type))[0] == 300


def test_unset_limits_stay_unset_until_the_device_is_known():
    assert limits(EngineArgs()) == (None, None)
    with pytest.raises(EngineArgsError, match="max_num_seqs"):
        EngineArgs(max_num_seqs=0)
