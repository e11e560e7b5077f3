"""Tails: storages Python holds past their last access and lets go of within the step (a
local variable, a list of a model's intermediate outputs, HF GPT-2's input embeddings until
its forward returns).

No op reads a tail again, so taking one off the device costs one copy out and nothing back;
kept, it holds its bytes until it dies. A step is planned with its tails kept first (those alive
where no plan that keeps them can meet the budget are taken off at once); if that plan runs
over the budget, the tails alive at the ops where it does are taken off right after their
last access (``emit_schedule`` copies each out after its last write; the host
copy stays while Python holds it) and the step is planned again. Only then: moving every
tail of a HF Llama step at 40 % of its peak more than doubled the bytes copied out
(2.14 -> 4.92 MiB a step) for the same peak. The floor counts tails as movable whatever the
budget (``tails_taken``): some schedule can always take them off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning import prediction
from hyperpar.offload.planning.arrays import TraceArrays, arrays_given
from hyperpar.offload.planning.bounds import min_resident_bytes
from hyperpar.offload.planning.deficit_warnings import deficit_warnings_muted
from hyperpar.offload.planning.simulate import SimResult

PlanOnce = Callable[[ActivationTrace, TraceArrays], tuple[ResidencySchedule, SimResult]]


def plan_with_tails(trace: ActivationTrace, arrays: TraceArrays, plan: PlanOnce
                    ) -> tuple[ActivationTrace, ResidencySchedule, SimResult]:
    """``plan`` once with the tails kept and, if it runs over the budget where tails are
    alive, once more with those taken off; the trace returned is the one planned (its
    ``tail_sids`` are what the schedule takes off)."""
    tail = _tails(trace, arrays)
    if not tail.any():
        schedule, sim = plan(trace, arrays)
        return trace, schedule, sim
    budget = trace.memory_limit_bytes
    with arrays_given(trace, arrays):
        kept_floor = np.asarray(min_resident_bytes(trace))
    hit = _alive_where(arrays, tail, kept_floor > budget)  # no plan keeping these meets the budget
    if hit.any():
        trace, arrays = _take(trace, arrays, hit)
        tail &= ~hit
    with deficit_warnings_muted():  # said below if the tails do not help
        schedule, sim = plan(trace, arrays)
    if sim.peak_resident_bytes <= budget or not tail.any():
        if sim.peak_resident_bytes > budget:
            prediction.say_deficit(schedule)
        return trace, schedule, sim
    hit = _alive_where(arrays, tail, np.asarray(sim.resident_bytes) > budget)
    if not hit.any():
        prediction.say_deficit(schedule)
        return trace, schedule, sim
    trace, arrays = _take(trace, arrays, hit)
    schedule, sim = plan(trace, arrays)
    return trace, schedule, sim


def _alive_where(arrays: TraceArrays, tail: np.ndarray, over: np.ndarray) -> np.ndarray:
    """The tails alive past their last access at some op where ``over`` holds."""
    count = np.concatenate([[0], np.cumsum(over)])
    return tail & (count[arrays.end_op + 1] > count[arrays.last_op + 1])


def tails_taken(trace: ActivationTrace, arrays: TraceArrays) -> tuple[ActivationTrace, TraceArrays]:
    """The trace and its arrays with every tail taken off after its last access (what the
    floor assumes of the best schedule, whatever the budget)."""
    tail = _tails(trace, arrays)
    return _take(trace, arrays, tail) if tail.any() else (trace, arrays)


def _tails(trace: ActivationTrace, arrays: TraceArrays) -> np.ndarray:
    """Per storage of ``arrays``: alive past its last access, not retained, not pinned."""
    tail = arrays.end_op > arrays.last_op
    if tail.any() and len(arrays.pinned_sids):
        tail &= ~np.isin(arrays.sids, arrays.pinned_sids)
    if tail.any() and trace.retained_sids:
        tail &= ~np.isin(arrays.sids, np.fromiter(trace.retained_sids, dtype=np.int64))
    return tail


def _take(trace: ActivationTrace, arrays: TraceArrays, tail: np.ndarray
          ) -> tuple[ActivationTrace, TraceArrays]:
    end_op = arrays.end_op.copy()
    end_op[tail] = arrays.last_op[tail]
    tails = trace.tail_sids | frozenset(arrays.sids[tail].tolist())
    return replace(trace, tail_sids=tails), replace(arrays, end_op=end_op)
