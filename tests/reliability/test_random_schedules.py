"""Every planner on random traces: the schedule verifies, meets feasible budgets, and run on the
real ResidencyManager with random bytes gives every read back the bytes last written."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.planning import get_planner, min_feasible_budget, simulate, verify
from hyperpar.offload.runtime import HostPool, ResidencyManager, SyncCopyEngine
from tests.offload.planning.random_traces import random_trace
from tests.reliability.schedule_runner import DataLost, fresh_manager, run_schedule

PLANNERS = ("greedy", "timed")
MAX_EXAMPLES = 150


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None)
@given(rng=st.randoms(use_true_random=False), cap=st.sampled_from([1 << 40, 1 << 40, 2048, 0]),
       engine=st.sampled_from(["sync", "thread"]))
def test_planned_schedules_keep_data_on_the_real_runtime(rng: random.Random, cap: int, engine: str) -> None:
    trace = random_trace(rng, max_ops=40)
    feasible = trace.memory_limit_bytes >= min_feasible_budget(trace)
    for name in PLANNERS:
        schedule = get_planner(name).build(trace)
        verify(trace, schedule)
        sim = simulate(trace, schedule)
        instant = trace.d2h_bandwidth_gbps == 0 and trace.h2d_bandwidth_gbps == 0
        if feasible and instant:
            assert sim.peak_resident_bytes <= trace.memory_limit_bytes, name
        if schedule.deficit_bytes == 0:
            assert sim.peak_resident_bytes <= trace.memory_limit_bytes, name
        manager = fresh_manager(cap, engine)
        measured = run_schedule(trace, schedule, manager, torch.Generator().manual_seed(rng.getrandbits(32)))
        if cap == 1 << 40:  # nothing refused by the pool: the device holds what the simulation says
            for i, (real, predicted) in enumerate(zip(measured, sim.resident_bytes, strict=True)):
                assert real <= predicted, f"{name}: op {i} holds {real} B, simulated {predicted} B"
        manager.clear()
        manager.engine.close()
        assert manager.pool.in_use_bytes == 0 and not manager.entries and manager.resident_bytes == 0


class _CorruptingEngine(SyncCopyEngine):
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: object = None, label: int = -1) -> None:
        dst.copy_(src)
        dst[:1].add_(1)
        return None


def test_the_runner_notices_corrupted_bytes() -> None:
    """The property above could only fail if the runner sees bad data: show that it does."""
    rng = random.Random(3)
    for _ in range(50):
        trace = random_trace(rng, max_ops=40)
        schedule = get_planner("greedy").build(trace)
        if any(a.kind is Act.COPY_H2D for _, _, a in schedule.actions()):
            break
    manager = ResidencyManager(torch.device("cpu"), HostPool(1 << 40), _CorruptingEngine())
    with pytest.raises(DataLost, match="with other bytes than written"):
        run_schedule(trace, schedule, manager, torch.Generator().manual_seed(0))
