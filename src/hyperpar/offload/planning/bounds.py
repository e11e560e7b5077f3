"""What no schedule can avoid: the floor under resident bytes, hence feasibility.

At op ``k`` a schedule must hold every storage the op accesses, plus retained storages
past their last access (nothing reads them again, so nothing can bring them back before
the step ends). Every other live storage sits strictly inside a gap between two of its
accesses and can be moved off for op ``k``. With copies that take no time this floor is
reachable, so a budget is feasible exactly when it is >= the floor's maximum.
"""

from __future__ import annotations

from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.planning.gaps import last_accesses


def min_resident_bytes(trace: ActivationTrace) -> list[int]:
    n = trace.num_ops
    sizes = trace.storage_sizes
    delta = [0] * (n + 1)
    for i, op in enumerate(trace.ops):
        for acc in op.accesses:
            delta[i] += sizes.get(acc.storage_id, 0)
            delta[i + 1] -= sizes.get(acc.storage_id, 0)
    for sid, last in last_accesses(trace).items():
        if sid in trace.retained_sids and last + 1 < n:
            delta[last + 1] += sizes.get(sid, 0)
            delta[n] -= sizes.get(sid, 0)
    out, running = [], 0
    for i in range(n):
        running += delta[i]
        out.append(running)
    return out


def min_feasible_budget(trace: ActivationTrace) -> int:
    return max(min_resident_bytes(trace), default=0)
