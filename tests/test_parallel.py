"""engine/parallel.py: TensorParallel's sharding arithmetic, and its collectives on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from llmctl.engine.parallel import TensorParallel, TensorParallelError
from tp_helpers import run_ranks


def test_single_is_the_identity():
    tp = TensorParallel.single()
    x = torch.arange(6.0).view(2, 3)
    assert tp.is_single and tp.is_driver
    assert tp.all_reduce(x) is x and tp.all_gather(x) is x and tp.broadcast(x) is x
    assert tp.partition(7, "heads") == (0, 7)
    assert tp.kv_head_range(3) == (0, 3)


def test_rank_outside_the_size_is_refused():
    with pytest.raises(TensorParallelError, match="rank 2 of size 2"):
        TensorParallel(2, 2)


def test_partition_splits_evenly_and_names_what_does_not_divide():
    assert [TensorParallel(r, 4).partition(8, "heads") for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    with pytest.raises(TensorParallelError, match=r"attention heads \(6\) is not divisible by the tensor-parallel "
                                                  r"size \(4\)"):
        TensorParallel(1, 4).partition(6, "attention heads")


def test_padded_partition_covers_a_vocabulary_that_does_not_divide():
    parts = [TensorParallel(r, 4).padded_partition(10) for r in range(4)]
    assert parts == [(0, 3), (3, 3), (6, 3), (9, 3)]  # the last part runs 2 rows past the vocabulary


def test_kv_heads_fewer_than_ranks_are_replicated():
    assert [TensorParallel(r, 4).kv_head_range(8) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [TensorParallel(r, 4).kv_head_range(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [TensorParallel(r, 2).kv_head_range(1) for r in range(2)] == [(0, 1), (0, 1)]
    with pytest.raises(TensorParallelError, match="neither a divisor nor a multiple"):
        TensorParallel(0, 4).kv_head_range(3)


def _collectives(tp: TensorParallel):
    base = torch.arange(6, dtype=torch.float32).view(2, 3)
    reduced = tp.all_reduce(base * (tp.rank + 1)).tolist()
    gathered = tp.all_gather(base + 10 * tp.rank, dim=-1).tolist()
    gathered_rows = tp.all_gather(base[:1] + 10 * tp.rank, dim=0).tolist()
    sent = tp.broadcast(torch.full((3,), float(tp.rank + 7)), src=0).tolist()
    return tp.rank, tp.size, reduced, gathered, gathered_rows, sent


def test_collectives_on_two_gloo_ranks():
    results = run_ranks(_collectives, 2)
    base = torch.arange(6, dtype=torch.float32).view(2, 3)
    for rank, (got_rank, size, reduced, gathered, rows, sent) in enumerate(results):
        assert (got_rank, size) == (rank, 2)
        assert reduced == (base * 3).tolist()
        assert gathered == torch.cat([base, base + 10], dim=-1).tolist()
        assert rows == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]
        assert sent == [7.0, 7.0, 7.0]
