"""The packed trace and schedule a session keeps rebuild exactly what was packed."""

from __future__ import annotations

import gc
from array import array

import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.ir import (
    AccessKind,
    ActivationTrace,
    OpGuide,
    ResidencySchedule,
    StorageAccess,
    TraceOp,
)
from hyperpar.offload.ir.packed import PackedTrace
from hyperpar.offload.ir.packed_schedule import PackedSchedule
from hyperpar.offload.planning import get_planner
from hyperpar.offload.planning.synthetic import synthetic_trace


def _session_trace() -> tuple[ActivationTrace, ResidencySchedule]:
    w = torch.randn(8, 8, requires_grad=True)
    session = OffloadSession(OffloadConfig(max_resident_fraction=0.5))
    with session:
        x = torch.randn(4, 8)
        for _ in range(3):
            x = torch.relu(x @ w)
        x.sum().backward()
    assert session.trace is not None and session.schedule is not None
    return session.trace, session.schedule


def test_a_session_trace_round_trips_through_its_packed_form() -> None:
    trace, schedule = _session_trace()
    assert trace.guides and any(g.output_bindings for g in trace.guides)
    doc, sched_doc = trace.to_dict(), schedule.to_dict()
    packed, packed_schedule = PackedTrace(trace), PackedSchedule(schedule)
    assert packed.unpack() is trace  # the same object while it is held
    del trace, schedule
    gc.collect()
    rebuilt, rebuilt_schedule = packed.unpack(), packed_schedule.unpack()
    assert rebuilt.to_dict() == doc and rebuilt_schedule.to_dict() == sched_doc
    assert [g.output_bindings for g in rebuilt.guides] == [g.output_bindings for g in
                                                           ActivationTrace.from_dict(doc).guides]
    assert packed.ops(3) == rebuilt.ops[:3] and packed.guides(3) == rebuilt.guides[:3]
    assert packed.size_of(0) == rebuilt.storage_sizes[0] and packed.size_of(10**9, -1) == -1


def test_a_synthetic_trace_without_guides_round_trips_and_shares_its_structure() -> None:
    trace = synthetic_trace(2_000, seed=3)
    trace.death_ops = {1: 40, 7: 90}
    trace.tail_sids = frozenset({3, 5})
    schedule = get_planner("greedy").build(trace)
    doc, sched_doc = trace.to_dict(), schedule.to_dict()
    packed, packed_schedule = PackedTrace(trace), PackedSchedule(schedule)
    resized = ActivationTrace.from_dict(doc)
    resized.storage_sizes = {sid: 2 * n for sid, n in resized.storage_sizes.items()}
    assert PackedTrace(resized, like=packed).structure is packed.structure
    del trace, schedule, resized
    gc.collect()
    assert packed.unpack().to_dict() == doc and packed_schedule.unpack().to_dict() == sched_doc
    assert doc["tail_sids"] == [3, 5] and ActivationTrace.from_dict(doc).tail_sids == {3, 5}


def test_columns_of_a_small_trace_are_as_laid_out() -> None:
    r, w = AccessKind.READ, AccessKind.WRITE
    ops = [TraceOp("a", 1.5, (StorageAccess(0, 4, w), StorageAccess(0, 2, r))), TraceOp("b", 0.5, ()),
           TraceOp("c", 2.0, (StorageAccess(2, 4, r),))]
    meta = (((2, 3), "float32"), None)
    guides = [OpGuide("a", 3, {2: 9, 0: 4}, meta, (2, -1)), OpGuide("b", 0, {}, (), ()),
              OpGuide("c", 1, {0: 7}, (((2, 3), "float32"), None), (4,))]
    trace = ActivationTrace(ops, {4: 10, 2: 20, 9: 1, 7: 2}, guides=guides)
    packed = PackedTrace(trace)
    st = packed.structure
    assert st.names == ("a", "b", "c") and st.guide_names is None
    assert st.access_start == array("q", [0, 2, 2, 3]) and st.access_sid == array("q", [4, 2, 4])
    assert st.access_write == bytes([1, 0, 0]) and packed.duration_ms == array("d", [1.5, 0.5, 2.0])
    assert st.bind_start == array("q", [0, 2, 2, 3]) and st.bind_leaf == array("q", [0, 2, 0])
    assert st.bind_sid == array("q", [4, 9, 7]) and st.leaf_count == array("q", [3, 0, 1])
    assert st.input_start == array("q", [0, 2, 2, 3]) and st.input_sid == array("q", [2, -1, 4])
    assert st.meta_index == array("q", [0, 1, 0]) and st.metas == (meta, ())
    assert packed.guides() == guides and packed.ops() == ops
