"""`bench --gpu`'s interconnect figures on the CPU: nccl-tests' algbw/busbw arithmetic and the
all-reduce sweep itself over gloo with two local processes (the NCCL path differs only in backend)."""

from __future__ import annotations

import pytest

from llmctl.bench import collectives
from llmctl.bench.hardware import to_result


@pytest.mark.parametrize("world, factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_allreduce_busbw_factor_is_nccl_tests_2_n_minus_1_over_n(world, factor):
    assert collectives.allreduce_busbw_factor(world) == factor


def test_bandwidths_from_bytes_and_seconds():
    algbw, busbw = collectives.bandwidths(1 << 30, 0.01, 8)
    assert algbw == pytest.approx(107.374, abs=1e-3) and busbw == pytest.approx(algbw * 1.75)
    with pytest.raises(ValueError):
        collectives.allreduce_busbw_factor(0)


def test_gloo_sweep_over_two_processes_reports_correct_sums_and_busbw():
    sizes = [1 << 12, 1 << 16]
    rows = collectives.allreduce_sweep(2, sizes, backend="gloo", reps=3, warmup=1)
    assert [row.nbytes for row in rows] == sizes
    for row in rows:
        assert len(row.seconds) == 3 and all(s > 0 for s in row.seconds) and row.wrong_elements == 0
    result = to_result(collectives.to_measured(rows[1], 2, "gloo"), "cpu", None)
    assert result.name == "allreduce_busbw" and result.unit == "GB/s" and result.median > 0
    assert result.params["busbw_factor"] == 1.0 and result.params["wrong_elements"] == 0
    assert result.params["algbw_median_gbs"] == pytest.approx(result.median, rel=0.01)  # n=2: busbw = algbw
