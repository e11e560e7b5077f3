from __future__ import annotations

import pytest

from hyperpar.offload.ir import ResidencySchedule
from hyperpar.offload.planning.emit import emit_schedule
from hyperpar.offload.planning.simulate import simulate
from tests.offload.planning.test_verify import D2H, FREE, H2D, schedule_for
from tests.offload.planning.trace_builders import make_trace

MB = 1_000_000
# 1 MB takes 1 ms down (1 GB/s) and 2 ms up (0.5 GB/s).
TRACE = make_trace(
    [("w1", 1.0), ("w2", 2.0), ("r2", 2.0), ("r1", 1.0)], {1: MB, 2: 10}, budget=0, d2h_gbps=1.0, h2d_gbps=0.5
)


def test_no_offload_matches_the_trace() -> None:
    sim = simulate(TRACE, emit_schedule(TRACE, [], "none"))
    assert sim.resident_bytes == TRACE.resident_bytes_without_offload()
    # without releases everything stays until the end
    assert simulate(TRACE, ResidencySchedule.empty(4)).resident_bytes[3] == MB + 10
    assert sim.predicted_step_ms == 6.0 and sim.exposed_wait_ms == 0.0 and sim.overhead == 0.0


def test_prefetch_at_the_consumer_is_exposed() -> None:
    sched = schedule_for(4, pre={3: [(H2D, 1)]}, post={0: [(D2H, 1), (FREE, 1)], 2: [(FREE, 2)]})
    sim = simulate(TRACE, sched)
    assert sim.op_start_ms == [0.0, 1.0, 3.0, 7.0]
    assert sim.exposed_wait_ms == pytest.approx(2.0)
    assert sim.predicted_step_ms == pytest.approx(8.0)
    assert sim.d2h_lane == [(1.0, 2.0, 1)] and sim.h2d_lane == [(5.0, 7.0, 1)]
    # op 1 starts (t=1) before the D2H ends (t=2): sid 1 still counts there.
    assert sim.resident_bytes == [MB, MB + 10, 10, MB]
    assert sim.peak_resident_bytes == MB + 10 and sim.peak_op == 1
    assert sim.bytes_d2h == MB and sim.bytes_h2d == MB


def test_early_prefetch_hides_the_copy_but_counts_from_issue() -> None:
    sched = schedule_for(4, pre={2: [(H2D, 1)]}, post={0: [(D2H, 1), (FREE, 1)], 2: [(FREE, 2)]})
    sim = simulate(TRACE, sched)
    assert sim.exposed_wait_ms == 0.0 and sim.predicted_step_ms == 6.0
    assert sim.resident_bytes == [MB, MB + 10, MB + 10, MB]


def test_write_waits_for_the_copy_out() -> None:
    trace = make_trace([("w1", 1.0), ("w1", 1.0)], {1: MB}, budget=0, d2h_gbps=1.0, h2d_gbps=1.0)
    sim = simulate(trace, schedule_for(2, post={0: [(D2H, 1)]}))
    assert sim.op_wait_ms == [0.0, 1.0]


def test_copies_queue_in_issue_order_on_one_lane() -> None:
    trace = make_trace([("w1 w2", 1.0), ("w3", 10.0), ("r1 r2", 1.0)], {1: MB, 2: MB, 3: 1}, budget=0,
                       d2h_gbps=1.0, h2d_gbps=1.0)
    sched = schedule_for(
        3, pre={2: [(H2D, 1), (H2D, 2)]}, post={0: [(D2H, 1), (D2H, 2), (FREE, 1), (FREE, 2)]}
    )
    sim = simulate(trace, sched)
    assert sim.d2h_lane == [(1.0, 2.0, 1), (2.0, 3.0, 2)]
    assert sim.h2d_lane == [(11.0, 12.0, 1), (12.0, 13.0, 2)]
    assert sim.op_wait_ms == [0.0, 0.0, 2.0]
    # both stay counted at op 1, which starts while they are still being copied out
    assert sim.resident_bytes == [2 * MB, 2 * MB + 1, 2 * MB + 1]


def test_zero_bandwidth_means_instant_copies() -> None:
    trace = make_trace(["w1", "w2", "r2", "r1"], {1: MB, 2: 10}, budget=0)
    sched = schedule_for(4, pre={3: [(H2D, 1)]}, post={0: [(D2H, 1), (FREE, 1)], 2: [(FREE, 2)]})
    sim = simulate(trace, sched)
    assert sim.resident_bytes == [MB, 10, 10, MB]
    assert sim.exposed_wait_ms == 0.0
