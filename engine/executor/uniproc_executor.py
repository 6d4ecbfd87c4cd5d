"""`UniProcExecutor`: the `Executor` (abstract.py) over the one `ModelRunner` in this process."""

from __future__ import annotations

from typing import Optional

import torch

from llmctl.engine.model_runner import AsyncModelRunnerOutput, ModelRunner, RunnerConfig
from llmctl.engine.sampler import SamplingRow
from llmctl.engine.step_types import ModelRunnerOutput, ScheduledSeq


class UniProcExecutor:
    """The runner in this process (tensor_parallel_size 1)."""

    def __init__(self, config: RunnerConfig):
        self.runner = ModelRunner(config)
        self.num_blocks = self.runner.num_blocks
        self.block_size = self.runner.block_size
        self.device = self.runner.device
        self.dtype = config.dtype
        self.weight_bytes = self.runner.weight_bytes

    max_concurrent_batches = 1  # one batch at a time: the engine calls execute

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    def execute(self, scheduled: list[ScheduledSeq], rows: list[Optional[SamplingRow]]) -> ModelRunnerOutput:
        return self.runner.execute(scheduled, rows)

    def execute_async(self, scheduled: list[ScheduledSeq],
                      rows: list[Optional[SamplingRow]]) -> AsyncModelRunnerOutput:
        return self.runner.execute_async(scheduled, rows)

    def idle_step(self) -> None:
        """A data-parallel replica's share of the others' step: its MoE layers' exchanges, no tokens."""
        self.runner.idle_step()

    def make_generator(self, seed: int) -> torch.Generator:
        return self.runner.make_generator(seed)

    def truncate_kept_state(self, seq_id: int, num_tokens: int) -> None:
        """A verify row's rejected drafts were rolled back: only the sequence's first `num_tokens` K/V
        still hold."""
        self.runner.truncate_kept_state(seq_id, num_tokens)

    def release_kept_state(self) -> None:
        """Drop what the runner keeps between steps (the torch backend's decode K/V): the engine went
        idle, or a step failed and may have left it half-written."""
        self.runner.release_kept_state()

    def release_after_out_of_memory(self) -> None:
        """Before a smaller retry: drop the kept state and hand the failed forward's cached device
        blocks back."""
        self.runner.release_kept_state()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def check_health(self) -> None:
        """In-process: the runner cannot fail apart from the engine."""

    def shutdown(self) -> None:
        """Nothing was started."""
