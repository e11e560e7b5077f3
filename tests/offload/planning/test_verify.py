from __future__ import annotations

import pytest

from hyperpar.offload.ir import ResidencyAction, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.planning import GreedyPlanner
from hyperpar.offload.planning.verify import ScheduleError, verify
from tests.offload.planning.trace_builders import make_trace

D2H, H2D, FREE, FREE_HOST = Act.COPY_D2H, Act.COPY_H2D, Act.RELEASE_DEVICE, Act.RELEASE_HOST


def schedule_for(n: int, pre: dict | None = None, post: dict | None = None) -> ResidencySchedule:
    s = ResidencySchedule.empty(n)
    for op, acts in (pre or {}).items():
        s.pre[op] = [ResidencyAction(k, sid) for k, sid in acts]
    for op, acts in (post or {}).items():
        s.post[op] = [ResidencyAction(k, sid) for k, sid in acts]
    return s


TRACE = make_trace(["w1", "w2", "r2", "r1", "w3"], {1: 10, 2: 10, 3: 10}, budget=0)


def check_error(schedule: ResidencySchedule, op: int | None, sid: int | None, words: str, trace=TRACE):
    with pytest.raises(ScheduleError, match=words) as info:
        verify(trace, schedule)
    assert info.value.op == op and info.value.storage_id == sid


def test_valid_schedule_passes() -> None:
    verify(TRACE, schedule_for(5, pre={3: [(H2D, 1)]}, post={0: [(D2H, 1), (FREE, 1)], 3: [(FREE_HOST, 1)]}))
    verify(TRACE, ResidencySchedule.empty(5))
    verify(TRACE, GreedyPlanner().build(TRACE))


def test_read_of_released_storage() -> None:
    sched = schedule_for(5, post={0: [(D2H, 1), (FREE, 1)]})
    check_error(sched, 3, 1, "op 3 .*reads storage 1.*not resident")


def test_release_without_host_copy_while_still_used() -> None:
    check_error(schedule_for(5, post={0: [(FREE, 1)]}), 0, 1, "without a host copy but op 3")


def test_stale_host_copy_brought_back() -> None:
    trace = make_trace(["w1", "w2", "w1", "r2", "r1"], {1: 10, 2: 10}, budget=0)
    sched = schedule_for(5, pre={4: [(H2D, 1)]}, post={0: [(D2H, 1)], 2: [(FREE, 1)]})
    check_error(sched, 4, 1, "stale", trace=trace)


def test_double_release() -> None:
    check_error(schedule_for(5, post={0: [(D2H, 1), (FREE, 1)], 1: [(FREE, 1)]}), 1, 1, "released twice")


def test_write_after_release() -> None:
    trace = make_trace(["w1", "w2", "w1"], {1: 10, 2: 10}, budget=0)
    check_error(schedule_for(3, post={0: [(D2H, 1), (FREE, 1)]}), 2, 1, "writes storage 1", trace=trace)


def test_h2d_without_host_copy() -> None:
    check_error(schedule_for(5, post={1: [(FREE, 2)]}), 1, 2, "without a host copy but op 2")
    check_error(schedule_for(5, pre={3: [(H2D, 1)]}), 3, 1, "no host copy")


def test_h2d_onto_resident_storage() -> None:
    check_error(schedule_for(5, pre={3: [(H2D, 1)]}, post={0: [(D2H, 1)]}), 3, 1, "already on the device")


def test_host_release_twice() -> None:
    sched = schedule_for(5, post={0: [(D2H, 1), (FREE_HOST, 1), (FREE_HOST, 1)]})
    check_error(sched, 0, 1, "release_host of storage 1")


def test_d2h_before_the_storage_exists() -> None:
    check_error(schedule_for(5, post={1: [(D2H, 3)]}), 1, 3, "not on the device")


def test_unknown_storage() -> None:
    check_error(schedule_for(5, post={1: [(FREE, 99)]}), 1, 99, "unknown storage 99")


def test_wrong_number_of_op_slots() -> None:
    check_error(ResidencySchedule.empty(4), None, None, "4 pre and 4 post op slots but the trace has 5")


def test_retained_storage_must_end_on_device() -> None:
    trace = make_trace(["w1", "w2", "r2"], {1: 10, 2: 10}, budget=0, retained=[1])
    check_error(schedule_for(3, post={0: [(D2H, 1), (FREE, 1)]}), 0, 1, "retained storage 1", trace=trace)
