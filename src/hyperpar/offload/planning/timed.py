"""The duration- and bandwidth-aware planner: hide transfers behind compute.

It works on the step's wait-free timeline (op ``k`` starts at the sum of the durations
before it) and knows what ``simulate`` will count:
- a gap relieves op ``k`` only if the storage's D2H, issued right after its last write
  before the gap, has finished before op ``k`` starts, and only until the op whose pre
  list issues its H2D (in-flight copies count against the budget);
- an H2D hides only if it is issued early enough to finish before its consumer.

(1) "Hidden" gaps, whose copies fit in the compute window (H2D issued as late as still
lands in time: least memory, no wait), are decided in D2H issue order, so each copy's
finish on the FIFO D2H lane is exact when its relief is judged; one is taken iff some op
of its relief is over budget. (2) If ops are still over, "exposed" gaps are taken, or
hidden ones extended, with the H2D at the consumer (memory bought with wait). (3) The
copies are laid out on their lanes exactly (D2H as soon as possible in issue order, H2D
as late as possible in deadline order) and every relief recomputed; (2) and (3) repeat
while lane contention leaves ops over budget. (4) Exposed copies the final peak does
not need are dropped if the simulator agrees. (5) Every H2D is pulled as early as the
budget allows (up to twice its copy time ahead), keeping the lane's order, to absorb
jitter and shorten exposed waits. What stays over budget is ``simulate``'s deficit.
"""

from __future__ import annotations

import logging
from bisect import bisect_left

import numpy as np

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning.arrays import (
    GapArrays,
    TraceArrays,
    gap_arrays,
    resident_without_offload,
    trace_arrays,
)
from hyperpar.offload.planning.covering import Covering, relieve, take_covering
from hyperpar.offload.planning.emit import as_gaps, emit_schedule
from hyperpar.offload.planning.gc_pause import gc_paused
from hyperpar.offload.planning.prediction import attach_prediction
from hyperpar.offload.planning.simulate import ms_per_byte

logger = logging.getLogger(__name__)


class TimedPlanner:
    name = "timed"

    def __init__(self, max_rounds: int = 8) -> None:
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(f"max_rounds must be a positive int, got {max_rounds!r}")
        self.max_rounds = max_rounds

    def build(self, trace: ActivationTrace) -> ResidencySchedule:
        with gc_paused():
            arrays = trace_arrays(trace)
            plan = _TimedPlan(trace, arrays)
            rounds = plan.run(self.max_rounds)
            before_drop = plan.snapshot()
            plan.pull_h2d_early()
            schedule = self._emit(trace, plan, arrays, rounds)
            if plan.pinned.any():
                # Exposed copies the wait-free model finds useless may still help: their wait
                # gives D2H copies time to land. Keep whichever the simulator likes better.
                plan.restore(before_drop)
                if plan.drop_useless_exposed():
                    plan.lay_out_lanes()
                    plan.pull_h2d_early()
                    leaner = self._emit(trace, plan, arrays, rounds)
                    if _cost(leaner) <= _cost(schedule):
                        schedule = leaner
        if schedule.deficit_bytes:
            logger.warning(
                "timed plan exceeds the budget of %d bytes by %d bytes at op %s",
                trace.memory_limit_bytes, schedule.deficit_bytes, schedule.deficit_op,
            )
        return schedule

    def _emit(self, trace: ActivationTrace, plan: _TimedPlan, arrays: TraceArrays,
              rounds: int) -> ResidencySchedule:
        idx = np.flatnonzero(plan.taken)
        g = plan.gaps
        chosen = as_gaps(g.start[idx], g.end[idx], g.copy_op[idx], g.sid[idx], g.size[idx])
        schedule = emit_schedule(trace, chosen, self.name, h2d_ops=plan.h2d_op[idx].tolist(), arrays=arrays)
        schedule.notes.update(evicted_gaps=len(chosen), exposed_gaps=int(plan.pinned[idx].sum()),
                              rounds=rounds)
        attach_prediction(trace, schedule, arrays, log=False)
        return schedule


def _cost(schedule: ResidencySchedule) -> tuple[int, int, float]:
    """Lower is better: the peak's deficit, then bytes over budget at every op, then wait."""
    n = schedule.notes
    return schedule.deficit_bytes, n["over_budget_byte_ops"], n["exposed_wait_ms"]


class _TimedPlan:
    def __init__(self, trace: ActivationTrace, arr: TraceArrays) -> None:
        self.budget = trace.memory_limit_bytes
        self.n = arr.num_ops
        self.base = resident_without_offload(arr)
        dur = arr.duration_ms
        self.op_end = np.cumsum(dur)
        self.op_start = self.op_end - dur
        g: GapArrays = gap_arrays(arr)
        self.gaps = g
        self.boundary = arr.gap_boundary  # copies back in after it (the fast path's turn to backward)
        self.d2h_ms = g.size * ms_per_byte(trace.d2h_bandwidth_gbps)
        self.h2d_ms = g.size * ms_per_byte(trace.h2d_bandwidth_gbps)
        # each gap alone on the lanes
        self.first_relieved = self._first_relieved(self.op_end[g.copy_op] + self.d2h_ms)
        self.hidden_h2d_op = self._latest_issue_op(self.op_start[g.end] - self.h2d_ms)
        count = len(g)
        self.taken = np.zeros(count, dtype=bool)
        self.pinned = np.zeros(count, dtype=bool)  # H2D issued at the consumer: exposed
        self.h2d_op = g.end.copy()
        self.resident = self.base.copy()

    def _first_relieved(self, d2h_end: np.ndarray) -> np.ndarray:
        """First op after the gap start that begins once the D2H is done."""
        return np.maximum(self.gaps.start + 1, np.searchsorted(self.op_start, d2h_end, side="left"))

    def _latest_issue_op(self, latest_start: np.ndarray, which: np.ndarray | None = None) -> np.ndarray:
        """Last op whose pre list still issues the H2D by ``latest_start`` (clamped into the gap)."""
        j = np.searchsorted(self.op_start, latest_start, side="right") - 1
        start, end = self.gaps.start, self.gaps.end
        if which is not None:
            start, end = start[which], end[which]
        lowest = start + 1 if self.boundary is None else np.maximum(start + 1, self.boundary + 1)
        return np.clip(j, lowest, end)

    def run(self, max_rounds: int) -> int:
        if self.n == 0 or int(self.base.max()) <= self.budget:
            return 0
        rounds = 0
        for rounds in range(1, max_rounds + 1):
            if rounds == 1:
                self._select_hidden_in_issue_order()
            # later rounds add no hidden gaps: judged off the lane, their copies would
            # delay every later D2H on the FIFO lane and move peaks rather than cut them
            took = self._select_exposed()
            if not took and rounds > 1:
                break
            self.lay_out_lanes()
            self._drop_empty_reliefs()
            if int(self.resident.max()) <= self.budget:
                break
        return rounds

    def _drop_empty_reliefs(self) -> None:
        """A hidden gap whose copies, laid out on the lanes, leave it no op to relieve only
        costs bandwidth (and its H2D, clamped into the gap, lands late): undo it."""
        for _ in range(4):
            empty = self.taken & ~self.pinned & (self.h2d_op - 1 < self.relief_lo)
            if not empty.any():
                return
            self.taken[empty] = False
            self.h2d_op[empty] = self.gaps.end[empty]
            self.lay_out_lanes()

    def snapshot(self) -> tuple[np.ndarray, ...]:
        return (self.taken.copy(), self.pinned.copy(), self.h2d_op.copy(), self.resident.copy(),
                getattr(self, "relief_lo", self.first_relieved).copy())

    def restore(self, state: tuple[np.ndarray, ...]) -> None:
        self.taken, self.pinned, self.h2d_op, self.resident, self.relief_lo = (a.copy() for a in state)

    def drop_useless_exposed(self) -> bool:
        """Undo exposed evictions the final peak does not need: they only cost wait. (Rounds
        may take some to chase ops that no eviction can fix, such as a copy still in flight.)"""
        g = self.gaps
        lo = getattr(self, "relief_lo", self.first_relieved)
        target = max(self.budget, int(self.resident.max()))
        resident = self.resident
        dropped = False
        exposed = np.flatnonzero(self.taken & self.pinned)
        for k in exposed[np.argsort(-g.size[exposed], kind="stable")].tolist():
            a, b, size = int(lo[k]), int(self.h2d_op[k]), int(g.size[k])
            if a < b and int(resident[a:b].max()) + size > target:
                continue
            resident[a:b] += size
            self.taken[k] = self.pinned[k] = False
            self.h2d_op[k] = g.end[k]
            dropped = True
        return dropped

    # --- selection ------------------------------------------------------------------
    def _select_hidden_in_issue_order(self) -> None:
        """Hidden gaps decided in D2H issue order, so each copy's place on the FIFO D2H lane
        (behind every copy taken before it) is exact when its relief is judged."""
        g = self.gaps
        cover = Covering(self.resident, self.budget)
        hidden_hi = self.hidden_h2d_op - 1
        first = self.first_relieved
        ok = np.flatnonzero(hidden_hi >= first)
        span = self.op_start[np.minimum(hidden_hi[ok] + 1, self.n - 1)] - self.op_start[first[ok]]
        ok = ok[np.lexsort((g.sid[ok], g.start[ok], -g.size[ok], -span, g.copy_op[ok]))]
        op_start = self.op_start.tolist()
        op_end = self.op_end.tolist()
        lane_free = 0.0
        copy_end: dict[tuple[int, int], float] = {}
        got: list[int] = []
        los: list[int] = []
        for k, sid, start, w, hi, size, cost in zip(
            ok.tolist(), g.sid[ok].tolist(), g.start[ok].tolist(), g.copy_op[ok].tolist(),
            hidden_hi[ok].tolist(), g.size[ok].tolist(), self.d2h_ms[ok].tolist(), strict=True
        ):
            end = copy_end.get((sid, w))
            fresh = end is None
            if fresh:
                end = max(op_end[w], lane_free) + cost
            lo = max(start + 1, bisect_left(op_start, end))
            if lo <= hi and cover.try_take(lo, hi, size):
                got.append(k)
                los.append(lo)
                if fresh:
                    copy_end[(sid, w)] = end
                    lane_free = end
        idx = np.asarray(got, dtype=np.int64)
        self.taken[idx] = True
        self.h2d_op[idx] = self.hidden_h2d_op[idx]
        lo_all = self.first_relieved.copy()
        lo_all[idx] = np.asarray(los, dtype=np.int64)
        self.resident = relieve(self.resident, lo_all, hidden_hi, g.size, idx)

    def _select_exposed(self) -> bool:
        """For ops still over budget: new gaps relieved up to their consumer, or taken ones
        extended there; their H2D is issued at the consumer (memory bought with wait)."""
        g, budget = self.gaps, self.budget
        if int(self.resident.max()) <= budget:
            return False
        relief_lo = self.first_relieved
        lo = np.where(self.taken, self.h2d_op, relief_lo)
        hi = g.end - 1
        cand = np.flatnonzero(~self.pinned & (hi >= lo))
        span = self.op_start[g.end[cand]] - self.op_start[lo[cand]]
        cand = cand[np.lexsort((g.sid[cand], g.start[cand], -g.size[cand], -span))]
        got = cand[take_covering(self.resident, budget, lo[cand], hi[cand], g.size[cand])]
        self.resident = relieve(self.resident, lo, hi, g.size, got)
        self.taken[got] = True
        self.pinned[got] = True
        self.h2d_op[got] = g.end[got]
        return len(got) > 0

    # --- lanes ----------------------------------------------------------------------
    def lay_out_lanes(self) -> None:
        """Exact D2H lane (ASAP, issue order) and H2D lane (ALAP by deadline); new reliefs."""
        g = self.gaps
        idx = np.flatnonzero(self.taken)
        # one D2H per (storage, copy op): gaps sharing a current host copy share it
        by_sid = idx[np.lexsort((g.start[idx], g.sid[idx]))]
        sid, copy_op = g.sid[by_sid], g.copy_op[by_sid]
        new_copy = np.ones(len(by_sid), dtype=bool)
        new_copy[1:] = (sid[1:] != sid[:-1]) | (copy_op[1:] != copy_op[:-1])
        copy_id = np.cumsum(new_copy) - 1
        jobs = by_sid[new_copy]
        lane_order = np.lexsort((g.sid[jobs], g.copy_op[jobs]))
        ready = self.op_end[g.copy_op[jobs]][lane_order]
        cost = np.cumsum(self.d2h_ms[jobs][lane_order])
        # end_k = max over m <= k of (ready_m + cost_m..k): a max-plus prefix scan
        ends_sorted = np.maximum.accumulate(ready - (cost - self.d2h_ms[jobs][lane_order])) + cost
        job_end = np.empty(len(jobs))
        job_end[lane_order] = ends_sorted
        d2h_end = np.empty(len(by_sid))
        d2h_end[:] = job_end[copy_id]
        first = np.empty(len(g))
        first[by_sid] = d2h_end
        lo = self._first_relieved(np.where(self.taken, first, 0.0))
        # H2D lane, latest start first from the last deadline back; an exposed copy (issued
        # at its consumer) occupies the lane right after its consumer's start
        deadline = self.op_start[g.end[idx]] + np.where(self.pinned[idx], self.h2d_ms[idx], 0.0)
        back = np.lexsort((-g.sid[idx], -deadline))
        c = self.h2d_ms[idx][back]
        csum = np.cumsum(c)
        start = np.minimum.accumulate(deadline[back] + (csum - c)) - csum
        h2d_op = self.h2d_op.copy()
        h2d_op[idx[back]] = self._latest_issue_op(start, idx[back])
        h2d_op = np.where(self.pinned, g.end, h2d_op)
        self.h2d_op = np.where(self.taken, np.maximum(h2d_op, g.start + 1), g.end)
        self.relief_lo = lo
        self.resident = relieve(self.base, lo, self.h2d_op - 1, g.size, idx)

    # --- prefetch placement ---------------------------------------------------------
    def pull_h2d_early(self) -> None:
        """Issue each H2D as early as the budget allows, up to a copy's length ahead of need."""
        g, budget = self.gaps, self.budget
        idx = np.flatnonzero(self.taken)
        if len(idx) == 0:
            return
        lo = getattr(self, "relief_lo", self.first_relieved)
        resident = self.resident.copy()
        # earliest useful issue: twice the copy's own time before the consumer
        earliest = self._latest_issue_op(self.op_start[g.end] - 2.0 * self.h2d_ms)
        # in deadline order, never ahead of an earlier consumer's copy: the lane is FIFO
        previous = 0
        for k in idx[np.lexsort((g.sid[idx], g.end[idx]))].tolist():
            j = int(self.h2d_op[k])
            stop = max(int(earliest[k]), int(lo[k]) + 1, int(g.start[k]) + 1, previous)
            previous = max(previous, min(j, stop))
            if j <= stop:
                continue
            window = resident[stop:j] + int(g.size[k])
            bad = np.flatnonzero(window > budget)
            new_j = stop + (int(bad[-1]) + 1 if len(bad) else 0)
            if new_j < j:
                resident[new_j:j] += int(g.size[k])
                self.h2d_op[k] = new_j
            previous = max(previous, int(self.h2d_op[k]))
        self.resident = resident
