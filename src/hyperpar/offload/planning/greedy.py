"""The reference system's greedy planner, minus its stale-copy bug.

It reasons in bytes only: a chosen gap frees its storage for every op strictly inside
it. Copies are issued at the last moment (H2D right before the consumer), so it ignores
op durations and bandwidth; ``TimedPlanner`` is the one that does not.

The decisions are those of ``greedy_reference.select_gaps_reference``; this version
takes O(accesses log ops) through ``covering.take_covering``.
"""

from __future__ import annotations

import numpy as np

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning.arrays import TraceArrays, gap_arrays, resident_without_offload, trace_arrays
from hyperpar.offload.planning.covering import take_covering
from hyperpar.offload.planning.emit import as_gaps, emit_schedule
from hyperpar.offload.planning.gaps import Gap
from hyperpar.offload.planning.gc_pause import gc_paused
from hyperpar.offload.planning.prediction import attach_prediction


def select_gaps_greedy(trace: ActivationTrace, arrays: TraceArrays | None = None) -> list[Gap]:
    arr = arrays if arrays is not None else trace_arrays(trace)
    gaps = gap_arrays(arr)
    order = np.lexsort((gaps.sid, gaps.start, -gaps.size, -(gaps.end - gaps.start)))
    taken = order[
        take_covering(
            resident_without_offload(arr), trace.memory_limit_bytes,
            gaps.start[order] + 1, gaps.end[order] - 1, gaps.size[order],
        )
    ]
    return as_gaps(gaps.start[taken], gaps.end[taken], gaps.copy_op[taken], gaps.sid[taken], gaps.size[taken])


class GreedyPlanner:
    name = "greedy"

    def build(self, trace: ActivationTrace) -> ResidencySchedule:
        with gc_paused():
            arrays = trace_arrays(trace)
            chosen = select_gaps_greedy(trace, arrays)
            schedule = emit_schedule(trace, chosen, self.name, arrays=arrays)
            schedule.notes["evicted_gaps"] = len(chosen)
            attach_prediction(trace, schedule, arrays)
        return schedule
