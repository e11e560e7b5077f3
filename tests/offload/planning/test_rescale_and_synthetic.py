from __future__ import annotations

import pytest

from hyperpar.offload.planning import get_planner, simulate, verify
from hyperpar.offload.planning.rescale import rescale_to_gpu
from hyperpar.offload.planning.sweep import sweep
from hyperpar.offload.planning.synthetic import synthetic_trace
from tests.offload.planning.trace_builders import make_trace


def test_rescale_keeps_proportions_and_hits_the_write_rate() -> None:
    trace = make_trace([("w1", 2.0), ("r1 w2", 6.0)], {1: 1_000_000, 2: 3_000_000}, budget=0)
    fast, factor = rescale_to_gpu(trace, write_gbps=100.0, d2h_gbps=50.0, h2d_gbps=25.0)
    # 4 MB written at 100 GB/s take 0.04 ms, split 1:3 like the measured durations
    assert [op.duration_ms for op in fast.ops] == pytest.approx([0.01, 0.03])
    assert factor == pytest.approx(0.04 / 8.0)
    assert (fast.d2h_bandwidth_gbps, fast.h2d_bandwidth_gbps) == (50.0, 25.0)
    assert [op.duration_ms for op in trace.ops] == [2.0, 6.0]  # the original is untouched
    with pytest.raises(ValueError, match="h2d_gbps must be > 0, got 0"):
        rescale_to_gpu(trace, 100.0, 50.0, 0)


def test_synthetic_trace_has_the_requested_size_and_plans_safely() -> None:
    trace = synthetic_trace(3_000, seed=3, budget_fraction=0.4)
    assert trace.num_ops == 3_000 and trace.retained_sids
    assert trace.memory_limit_bytes == int(trace.peak_bytes_without_offload() * 0.4)
    for name in ("greedy", "timed"):
        schedule = get_planner(name).build(trace)
        verify(trace, schedule)
        assert schedule.deficit_bytes == 0
        assert simulate(trace, schedule).peak_resident_bytes <= trace.memory_limit_bytes


def test_sweep_overhead_grows_as_the_budget_shrinks() -> None:
    trace = synthetic_trace(1_500, seed=1, d2h_gbps=50.0, h2d_gbps=50.0)
    points = sweep(trace, ("greedy", "timed"), [0.5, 1.0])
    by = {(p.planner, p.budget_fraction >= 0.99): p for p in points}
    for planner in ("greedy", "timed"):
        assert by[(planner, True)].overhead == pytest.approx(0.0, abs=1e-9)
        assert by[(planner, True)].bytes_d2h == 0
        assert by[(planner, False)].bytes_d2h > 0
    assert by[("timed", False)].exposed_wait_ms < by[("greedy", False)].exposed_wait_ms
