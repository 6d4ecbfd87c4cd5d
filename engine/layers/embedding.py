"""The token embedding, split by vocabulary over tensor-parallel ranks (vLLM's VocabParallelEmbedding).

Rank r of N holds rows [r * ceil(V / N), (r + 1) * ceil(V / N)) of the [V, hidden] table (the last
ranks' rows past V are zero padding, never looked up); a token outside a rank's rows contributes
zeros there, and an all-reduce (hidden x dtype bytes per token) sums the one rank that holds it. With
one rank it is a plain lookup. A tied lm_head shares this rank's part (the same split as
`LinearFactory.vocab_column`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.layers.linear import CheckpointSlice, copy_checked, new_parameter, rank_part
from llmctl.engine.parallel import TensorParallel


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp: TensorParallel = TensorParallel.single()):
        super().__init__()
        self.tp = tp
        self.vocab_start, self.rows = tp.padded_partition(vocab_size)
        part = CheckpointSlice(vocab_size, self.vocab_start, self.rows)
        new_parameter(self, "weight", torch.empty(self.rows, hidden_size, dtype=dtype), self.weight_loader,
                      shard_ids=(None,), checkpoint_rows={None: part}, checkpoint_cols=None)

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param.data, rank_part(param, loaded, shard_id))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.is_single:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.rows)
        hidden = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        hidden.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)

    def extra_repr(self) -> str:
        return f"rows={self.rows} from {self.vocab_start}, hidden={self.weight.shape[1]}"
