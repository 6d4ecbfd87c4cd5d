"""The executor: the one object `LLMEngine` runs model steps through.

The engine hands it a scheduled batch and, per row that samples, a `SamplingRow`; it gets back a
`ModelRunnerOutput` of plain lists aligned with the batch (tokens, log-probs). Besides that it
answers sizes (KV blocks, block size, bytes), makes per-request generators on the device, and
drops state kept between steps (past a rollback, after a failed or out-of-memory step, or when the
engine goes idle). Nothing else of the runner is the engine's business.

`UniProcExecutor` (uniproc_executor.py) runs the one `ModelRunner` in this process. `MultiprocExecutor`
(multiproc_executor.py, tensor parallel) keeps this method set: every rank runs the forward on
the batch's ids, positions and block tables, and the driver rank (in this process) samples, so the
`SamplingRow`s, which hold what cannot cross a process boundary (a request's `torch.Generator`,
logits-processor closures), never leave the engine's process; with async scheduling the driver's sampled
ids reach the other ranks' next inputs on the device (a broadcast on the model group). `check_health` raises when the model
side can no longer step (a rank died); `shutdown` stops what the executor started.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from llmctl.engine.sampler import SamplingRow
from llmctl.engine.step_types import ModelRunnerOutput, ScheduledSeq


class Executor(Protocol):
    num_blocks: int
    block_size: int
    device: torch.device
    dtype: torch.dtype
    weight_bytes: int  # what the model's tensors occupy (rank 0's share with tensor parallelism)
    # Batches the engine keeps in flight (the pipeline's stages). Above 1 the executor also has
    # `submit(scheduled, rows) -> pending` and `collect(pending) -> ModelRunnerOutput`, collected in order.
    max_concurrent_batches: int
    # Async scheduling (--async-scheduling) needs `execute_async(scheduled, rows) -> pending` too, whose
    # `pending.get_output()` returns the ModelRunnerOutput: both executors have it (MultiprocExecutor for tensor
    # parallelism: the driver sends the ids in flight to the other ranks on the device; pipeline stages overlap
    # through submit/collect instead, and EngineArgs refuses async scheduling with them).

    @property
    def kv_cache_bytes(self) -> int: ...

    def execute(self, scheduled: list[ScheduledSeq], rows: list[Optional[SamplingRow]]) -> ModelRunnerOutput: ...

    def make_generator(self, seed: int) -> torch.Generator: ...

    def truncate_kept_state(self, seq_id: int, num_tokens: int) -> None: ...

    def release_kept_state(self) -> None: ...

    def release_after_out_of_memory(self) -> None: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...
