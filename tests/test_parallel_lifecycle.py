"""Parallel engines' life cycle (issue 43): `LLM.shutdown()` and `with LLM(...)` release the ranks and the
process group, so one process builds one parallel engine after another."""

from __future__ import annotations

import multiprocessing

import pytest
import torch.distributed as dist

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import EngineError

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [9, 8, 7]]


def _llm(folder, **extra) -> LLM:
    return LLM(model=str(folder), device="cpu", dtype="float32", max_model_len=64, block_size=16,
               num_kv_blocks=16, skip_tokenizer_init=True, tensor_parallel_size=2, **extra)


def _ranks_left() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("llmctl-rank-")]


def test_two_parallel_engines_one_after_the_other_in_one_process(tiny_models):
    with _llm(tiny_models["llama"]) as first:
        want = [o.outputs[0].token_ids for o in first.generate(PROMPTS, PARAMS)]
        with pytest.raises(EngineError, match="call shutdown"):  # one parallel engine per process at a time
            _llm(tiny_models["llama"])
    assert not dist.is_initialized() and not _ranks_left()
    second = _llm(tiny_models["llama"])
    try:
        got = [o.outputs[0].token_ids for o in second.generate(PROMPTS, PARAMS)]
    finally:
        second.shutdown()
        second.shutdown()  # idempotent
    assert got == want and len(got[0]) == 6
    assert not dist.is_initialized() and not _ranks_left()
