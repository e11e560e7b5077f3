"""``emit_schedule`` and ``simulate`` work on packed arrays; they must give exactly what the plain
versions (``plan_reference``) give, on schedules with and without their action objects made."""

from __future__ import annotations

import dataclasses
import random

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.ir.packed_schedule import PackedActionsSchedule, PackedSchedule, action_count
from hyperpar.offload.planning import get_planner
from hyperpar.offload.planning.emit import emit_schedule
from hyperpar.offload.planning.gaps import find_gaps
from hyperpar.offload.planning.simulate import simulate
from hyperpar.offload.planning.synthetic import synthetic_trace
from tests.offload.planning.plan_reference import emit_reference, simulate_reference
from tests.offload.planning.random_traces import random_trace


def _trace(rng: random.Random) -> ActivationTrace:
    trace = random_trace(rng, max_ops=40)
    lifetimes = trace.lifetimes()
    n = trace.num_ops
    trace.death_ops = {sid: min(n - 1, last + rng.randint(1, 3)) for sid, (_, last) in lifetimes.items()
                       if rng.random() < 0.2}
    if rng.random() < 0.3:
        trace.pinned_sids = frozenset(s for s in trace.storage_sizes if rng.random() < 0.2)
    if rng.random() < 0.4:  # held past their last access, moved off after it (see emit_schedule)
        trace.tail_sids = frozenset(s for s in trace.storage_sizes
                                    if s not in trace.death_ops and rng.random() < 0.3)
    return trace


def _packed(schedule: ResidencySchedule) -> tuple[bytes, bytes, bytes]:
    p = PackedSchedule(schedule)
    return p.start.tobytes(), p.kind, p.sid.tobytes()


def test_emit_matches_the_reference_on_random_gap_choices() -> None:
    rng = random.Random(7)
    emitted = 0
    for _ in range(400):
        trace = _trace(rng)
        gaps = find_gaps(trace)
        chosen = rng.sample(gaps, k=rng.randint(0, len(gaps)))
        h2d = [rng.randint(g.start + 1, g.end) for g in chosen] if rng.random() < 0.5 else None
        fast = emit_schedule(trace, chosen, "p", h2d_ops=h2d)
        plain = emit_reference(trace, chosen, "p", h2d_ops=h2d)
        assert isinstance(fast, PackedActionsSchedule) and fast._packed is not None
        assert _packed(fast) == _packed(plain) and action_count(fast) == action_count(plain)
        assert fast.num_ops == plain.num_ops
        assert fast == plain and plain == fast and fast._packed is None  # comparing makes the lists
        assert fast.to_dict() == plain.to_dict()
        emitted += len(chosen) > 0
    assert emitted > 200


def test_simulate_matches_the_reference_including_waits() -> None:
    rng = random.Random(11)
    waited = 0
    for _ in range(300):
        trace = _trace(rng)
        for planner in ("greedy", "timed"):
            schedule = get_planner(planner).build(trace)
            expected = simulate_reference(trace, ResidencySchedule.from_dict(schedule.to_dict()))
            assert simulate(trace, schedule) == expected  # from the packed arrays
            assert simulate(trace, ResidencySchedule.from_dict(schedule.to_dict())) == expected  # objects
            waited += expected.exposed_wait_ms > 0
    assert waited > 50


def test_simulate_matches_the_reference_on_a_long_trace_with_waits() -> None:
    trace = random_trace(random.Random(0), max_ops=3_000, timed=True)  # 1578 ops
    trace.d2h_bandwidth_gbps = trace.h2d_bandwidth_gbps = 0.0005  # copies slower than ops: waits
    trace.memory_limit_bytes = int(trace.peak_bytes_without_offload() * 0.4)
    for planner in ("greedy", "timed"):
        schedule = get_planner(planner).build(trace)
        expected = simulate_reference(trace, ResidencySchedule.from_dict(schedule.to_dict()))
        assert expected.exposed_wait_ms > 0 and sum(w > 0 for w in expected.op_wait_ms) > 10
        assert simulate(trace, schedule) == expected


def test_a_packed_actions_schedule_acts_as_a_plain_one() -> None:
    trace = synthetic_trace(300, seed=2)
    trace.memory_limit_bytes = int(trace.peak_bytes_without_offload() * 0.5)
    schedule = get_planner("greedy").build(trace)
    assert isinstance(schedule, PackedActionsSchedule) and schedule._packed is not None
    plain = ResidencySchedule.from_dict(schedule.to_dict())
    renamed = dataclasses.replace(schedule, planner="other")
    assert renamed.planner == "other" and renamed.pre == plain.pre and renamed != plain
    schedule.pre[0].append(plain.post[1][0])  # an edit of the made lists is the schedule
    assert action_count(schedule) == action_count(plain) + 1
    assert _packed(schedule) != _packed(plain)
    assert simulate(trace, schedule) == simulate_reference(trace, schedule)
    schedule.post = plain.post
    assert schedule.post is plain.post
