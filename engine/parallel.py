"""Tensor parallelism: which rank this process is, and the collectives the sharded model calls; pipeline
parallelism: which stage (its decoder layers, `pipeline_layer_ranges`) and its sends between stages.

A `TensorParallel` is passed down at construction (runner -> model -> layers); nothing reads a
global. `TensorParallel.single()` (size 1) makes every collective the identity, so the one-device
model is the same code with no communication. With size > 1 the collectives run over
`torch.distributed` (gloo on CPU, NCCL on CUDA) on `group` (None: the default process group, set up
by whoever starts the ranks: the multi-rank executor, or a test).

The model calls two collectives per decoder layer (Megatron-LM's layout, as vLLM does): the
all-reduce after the row-parallel o_proj and after down_proj, each of hidden x dtype bytes per
token; plus one all-gather of the vocab-parallel lm_head's logits (vocab / size x 4 bytes per
sampled row and rank) and one all-reduce of the vocab-parallel embedding (hidden x dtype per token).

Sharding rules (vLLM's):
- a dimension split evenly (`partition`): attention heads, MLP intermediate size; a size that does
  not divide is refused with the numbers named;
- the vocabulary split in equal padded parts (`padded_partition`): the last rank's part may run past
  the vocabulary, its extra rows are zero and masked;
- KV heads fewer than ranks are replicated (`kv_head_range`): size must be a multiple of the KV
  heads, and each group of size / kv_heads ranks holds one KV head;
- expert parallelism (`expert_parallel`, --enable-expert-parallel): a mixture-of-experts layer's experts are
  not sliced but dealt out whole, rank r holding the r-th contiguous num_experts / size of them
  (`expert_ranges`); every rank routes every token (its hidden states are the same on all ranks), runs
  the pairs whose expert it holds and the partial sums are all-reduced, as vLLM's naive expert parallelism.
  With data-parallel replicas (`ExpertDataParallel`, `llmctl serve -dp D --enable-expert-parallel`) the experts
  are dealt over all D x T ranks (expert-parallel rank = replica x T + tensor-parallel rank) while attention
  stays per replica; each MoE layer gathers every replica's tokens, runs this rank's experts on all of them and
  hands each replica back the sums of its own rows (vLLM's attention-DP + EP, its all-gather/reduce-scatter form).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.nn.functional as F


class TensorParallelError(ValueError):
    """A model shape that cannot be split over the requested number of ranks."""


def expert_ranges(num_experts: int, size: int) -> list[range]:
    """The experts each of `size` expert-parallel ranks holds, in rank order: equal contiguous blocks."""
    if num_experts % size:
        raise TensorParallelError(f"the model's {num_experts} experts are not divisible by the expert-parallel "
                                  f"size ({size}: tensor-parallel x data-parallel size): each rank must hold "
                                  "whole experts")
    share = num_experts // size
    return [range(rank * share, (rank + 1) * share) for rank in range(size)]


def stateless_group(store, prefix: str, rank: int, size: int, device: torch.device, timeout_s: float):
    """A process group of its own over `store` (keys under `prefix`), outside torch.distributed's one default
    group per process: so the replicas' drivers, threads of the server's process, can each be a member
    (vLLM's stateless process groups). Called by every member at once; a thread needs its own store client.
    Used through its own methods (`allgather`, `reduce_scatter`): torch.distributed's functions know only
    the groups of the default one."""
    import torch.distributed as dist

    prefixed, timeout = dist.PrefixStore(prefix, store), timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


@dataclass(frozen=True)
class ExpertDataParallel:
    """This rank's data-parallel replica (`rank` of `size`) for the MoE layers: `group` joins the replicas'
    ranks of this tensor-parallel index (NCCL on CUDA, gloo on CPU), `count_group` (gloo) the same ranks
    for the token counts, which live on the host. Every replica must run each MoE layer at once (an idle one
    with no tokens: engine/executor/lockstep.py). `step_counts`: every replica's tokens in the forward under
    way, exchanged once per forward (`begin_step`) rather than per layer (gloo's latency is ~0.8 ms here)."""

    rank: int
    size: int
    group: Any
    count_group: Any
    step_counts: list = field(default_factory=list, compare=False, repr=False)

    def begin_step(self, num_tokens: int) -> None:
        """Before a forward's first MoE layer (every replica at once): every replica's token count."""
        mine = torch.tensor([num_tokens], dtype=torch.long)
        counts = [torch.empty_like(mine) for _ in range(self.size)]
        self.count_group.allgather([counts], [mine]).wait()
        self.step_counts[:] = [int(count) for count in counts]

    def dispatch(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every replica's tokens ([sum of counts, H], in replica order); all-gathered padded to the largest
        count, as the collective wants equal shapes."""
        counts = self.step_counts
        if len(counts) != self.size or counts[self.rank] != hidden.shape[0]:
            raise RuntimeError(f"an MoE layer's {hidden.shape[0]} tokens do not match this forward's exchanged "
                               f"counts {counts} (begin_step runs before the first MoE layer)")
        width = max(counts)
        padded = F.pad(hidden, (0, 0, 0, width - hidden.shape[0])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self.group.allgather([parts], [padded]).wait()
        return torch.cat([part[:count] for part, count in zip(parts, counts)])

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """This replica's rows of `partial` (every replica's tokens, this rank's experts' sums) summed over the
        replicas: each replica's rows go to it in one all-to-all (a reduce-scatter moves the same bytes, but
        gloo's took 2.5 ms against the all-to-all's 0.5 ms here) and are added in replica order."""
        counts, width = self.step_counts, max(self.step_counts)
        send = torch.stack([F.pad(chunk, (0, 0, 0, width - chunk.shape[0])) for chunk in partial.split(counts)])
        received = torch.empty_like(send)
        self.group.alltoall_base(received, send, [], []).wait()
        return received.sum(0)[: counts[self.rank]]


def expert_data_parallel(master_addr: str, master_port: int, replica: int, size: int, tp_rank: int,
                         device: torch.device, timeout_s: float) -> ExpertDataParallel:
    """Replica `replica`'s `ExpertDataParallel` for its tensor-parallel rank `tp_rank`: joins the groups of that
    rank across the `size` replicas over the store at `master_addr:master_port` (every member calls it at once)."""
    import torch.distributed as dist

    store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    prefix = f"llmctl/experts/tp{tp_rank}"
    group = stateless_group(store, prefix, replica, size, device, timeout_s)
    counts = group if device.type != "cuda" else stateless_group(store, prefix + "/counts", replica, size,
                                                                  torch.device("cpu"), timeout_s)
    return ExpertDataParallel(replica, size, group, counts)


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: Optional[Any] = None  # a torch.distributed ProcessGroup; None: the default group
    expert_parallel: bool = False  # mixture-of-experts layers: whole experts per rank (`expert_range`), not refused
    data_parallel: Optional[ExpertDataParallel] = None  # experts dealt over the replicas' ranks too

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise TensorParallelError(f"tensor-parallel rank {self.rank} of size {self.size}")

    @classmethod
    def single(cls) -> "TensorParallel":
        """One rank: no sharding, every collective the identity."""
        return cls(0, 1, None)

    @classmethod
    def from_group(cls, group: Optional[Any] = None) -> "TensorParallel":
        """This process's rank and the size of `group` (None: the initialised default group)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise TensorParallelError("torch.distributed is not initialised (init_process_group first)")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def is_single(self) -> bool:
        return self.size == 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank in the engine's process, which samples."""
        return self.rank == 0

    # ---- how dimensions split ---------------------------------------------------------------------
    def partition(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's equal share of `total`; `what` names the dimension in the error."""
        if total % self.size:
            raise TensorParallelError(f"{what} ({total}) is not divisible by the tensor-parallel size ({self.size})")
        share = total // self.size
        return self.rank * share, share

    def padded_partition(self, total: int) -> tuple[int, int]:
        """(start, size) of this rank's part of `total` split in `size` equal parts of ceil(total / size):
        the last parts may run past `total` (the vocabulary's padding)."""
        share = -(-total // self.size)
        return self.rank * share, share

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads) this rank holds: an equal share when there are at least as many KV
        heads as ranks, else one head replicated on size / num_kv_heads ranks."""
        if num_kv_heads >= self.size:
            return self.partition(num_kv_heads, "the number of KV heads")
        if self.size % num_kv_heads:
            raise TensorParallelError(f"the tensor-parallel size ({self.size}) is neither a divisor nor a multiple "
                                      f"of the number of KV heads ({num_kv_heads})")
        return self.rank // (self.size // num_kv_heads), 1

    def attention_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(query heads, KV heads) this rank holds."""
        return self.partition(num_heads, "the number of attention heads")[1], self.kv_head_range(num_kv_heads)[1]

    @property
    def expert_parallel_size(self) -> int:
        """The ranks the experts are dealt over: tensor-parallel x data-parallel size (1: every rank has all)."""
        if not self.expert_parallel:
            return 1
        return self.size * (self.data_parallel.size if self.data_parallel is not None else 1)

    @property
    def expert_parallel_rank(self) -> int:
        return self.rank + (self.data_parallel.rank * self.size if self.data_parallel is not None else 0)

    def expert_range(self, num_experts: int) -> range:
        """The experts (global ids) this rank holds: all of them without expert parallelism."""
        if not self.expert_parallel:
            return range(num_experts)
        return expert_ranges(num_experts, self.expert_parallel_size)[self.expert_parallel_rank]

    # ---- collectives --------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (returns `tensor`)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all) concatenated along `dim`, in rank order."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `tensor` on every rank, in place (returns `tensor`)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.broadcast(tensor, src=self._global_rank(src), group=self.group)
        return tensor

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        import torch.distributed as dist

        return dist.get_global_rank(self.group, group_rank)


def pipeline_layer_ranges(num_layers: int, stages: int, counts: Optional[tuple[int, ...]] = None) -> list[range]:
    """Each pipeline stage's decoder layers: `counts` (--pp-layer-partition), else an even split whose
    remainder goes one layer each to the first stages."""
    if counts is None:
        if num_layers < stages:
            raise TensorParallelError(f"the model's {num_layers} decoder layers cannot fill {stages} pipeline stages")
        share, extra = divmod(num_layers, stages)
        counts = tuple(share + (stage < extra) for stage in range(stages))
    if sum(counts) != num_layers:
        raise TensorParallelError(f"pp_layer_partition {','.join(map(str, counts))} sums to {sum(counts)}, but the "
                                  f"model has {num_layers} decoder layers")
    starts = [sum(counts[:stage]) for stage in range(stages)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


@dataclass(frozen=True)
class PipelineParallel:
    """This rank's pipeline stage: its decoder layers (None: all of them, one stage), and the global ranks it
    receives hidden states from and sends them to (the same tensor-parallel rank of the stages around it),
    over `group` (all ranks: gloo on CPU, NCCL on CUDA)."""

    stage: int = 0
    size: int = 1
    layers: Optional[range] = None
    group: Optional[Any] = None
    previous_rank: Optional[int] = None
    next_rank: Optional[int] = None

    @property
    def is_single(self) -> bool:
        return self.size == 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        return range(num_layers) if self.layers is None else self.layers

    def send(self, *tensors: torch.Tensor) -> list:
        """To the next stage (the hidden states and the residual stream of every token of the step), without
        waiting: returns the sends' works (the caller waits on them before its next send), so a stage goes on
        to the next micro-batch while the next stage takes this one."""
        import torch.distributed as dist

        return [dist.isend(tensor.contiguous(), self.next_rank, group=self.group) for tensor in tensors]

    def receive(self, count: int, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> list[torch.Tensor]:
        """`count` tensors of `shape` from the previous stage, in the order it sent them."""
        import torch.distributed as dist

        tensors = [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)]
        for tensor in tensors:
            dist.recv(tensor, self.previous_rank, group=self.group)
        return tensors
