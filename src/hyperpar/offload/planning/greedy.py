"""The reference system's greedy planner, minus its stale-copy bug.

It reasons in bytes only: a chosen gap frees its storage for every op strictly inside
it. Copies are issued at the last moment (H2D right before the consumer), so it ignores
op durations and bandwidth; ``TimedPlanner`` is the one that does not.

The decisions are those of ``greedy_reference.select_gaps_reference``; this version
takes O(accesses log ops): resident bytes only ever go down, so an op that fits once
fits for good. Ops still over budget sit in a "next over-budget op" union-find (a gap
is taken iff one lies strictly inside it); their exact bytes come from a Fenwick tree
of the sizes taken so far, checked lazily when a gap asks.
"""

from __future__ import annotations

import numpy as np

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning.arrays import TraceArrays, gap_arrays, resident_without_offload, trace_arrays
from hyperpar.offload.planning.emit import as_gaps, emit_schedule
from hyperpar.offload.planning.gaps import Gap
from hyperpar.offload.planning.gc_pause import gc_paused
from hyperpar.offload.planning.prediction import attach_prediction


def select_gaps_greedy(trace: ActivationTrace, arrays: TraceArrays | None = None) -> list[Gap]:
    arr = arrays if arrays is not None else trace_arrays(trace)
    n = arr.num_ops
    budget = trace.memory_limit_bytes
    base = resident_without_offload(arr)
    if n == 0 or int(base.max()) <= budget:
        return []
    gaps = gap_arrays(arr)
    order = np.lexsort((gaps.sid, gaps.start, -gaps.size, -(gaps.end - gaps.start)))
    starts = gaps.start[order].tolist()
    ends = gaps.end[order].tolist()
    sizes = gaps.size[order].tolist()
    base_list = base.tolist()
    # nxt[x]: a candidate for the first op >= x still over budget (n: none)
    over = base > budget
    nxt = [*np.where(over, np.arange(n), np.arange(n) + 1).tolist(), n]
    fenwick = [0] * (n + 2)  # prefix sums of bytes taken off, at 1-based op + 1

    def find(x: int) -> int:
        root = x
        while nxt[root] != root:
            root = nxt[root]
        while nxt[x] != root:
            nxt[x], x = root, nxt[x]
        return root

    taken: list[int] = []
    delta = np.zeros(n + 1, dtype=np.int64)
    next_check = 1
    for k in range(len(starts)):
        a, b = starts[k], ends[k]
        x = find(a + 1)
        hit = False
        while x < b:
            i, freed = x + 1, 0
            while i > 0:
                freed += fenwick[i]
                i -= i & -i
            if base_list[x] - freed > budget:
                hit = True
                break
            nxt[x] = x + 1
            x = find(x + 1)
        if not hit:
            continue
        size = sizes[k]
        i = a + 2
        while i <= n + 1:
            fenwick[i] += size
            i += i & -i
        i = b + 1
        while i <= n + 1:
            fenwick[i] -= size
            i += i & -i
        taken.append(k)
        if len(taken) >= next_check:  # exact check now and then; exiting early changes nothing
            next_check *= 2
            idx = order[np.asarray(taken)]
            delta[:] = 0
            np.add.at(delta, gaps.start[idx] + 1, -gaps.size[idx])
            np.add.at(delta, gaps.end[idx], gaps.size[idx])
            if int((base + np.cumsum(delta[:-1])).max()) <= budget:
                break
    idx = order[np.asarray(taken, dtype=np.int64)]
    return as_gaps(gaps.start[idx], gaps.end[idx], gaps.copy_op[idx], gaps.sid[idx], gaps.size[idx])


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
