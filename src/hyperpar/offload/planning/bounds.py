"""What no schedule can avoid: the floor under resident bytes, hence feasibility.

At op ``k`` a schedule must hold every storage the op accesses, plus storages past their
last access that are still alive (retained ones, or held a while longer by Python: nothing
reads them again, so nothing can bring them back before they die), plus pinned storages
for their whole life. Every other live storage sits strictly inside a gap between two of
its accesses and can be moved off for op ``k``. With copies that take no time this floor is
reachable, so a budget is feasible exactly when it is >= the floor's maximum.
"""

from __future__ import annotations

import math

import numpy as np

from hyperpar.offload.ir import ActivationTrace


def min_resident_bytes(trace: ActivationTrace) -> list[int]:
    from hyperpar.offload.planning.arrays import trace_arrays, with_reserve

    arr = trace_arrays(trace)
    n = arr.num_ops
    delta = np.zeros(n + 1, dtype=np.int64)
    if n == 0:
        return []
    # every op holds what it accesses
    np.add.at(delta, arr.access_op, arr.access_size)
    np.add.at(delta, arr.access_op + 1, -arr.access_size)
    pinned = np.isin(arr.sids, arr.pinned_sids) if len(arr.pinned_sids) else np.zeros(len(arr.sids), bool)
    # after its last access nothing brings a storage back
    tail = (arr.end_op > arr.last_op) & ~pinned
    np.add.at(delta, arr.last_op[tail] + 1, arr.size[tail])
    np.add.at(delta, arr.end_op[tail] + 1, -arr.size[tail])
    if pinned.any():  # on the device from first to last op it lives, between accesses too
        counted = np.isin(arr.access_sid, arr.pinned_sids)
        np.add.at(delta, arr.access_op[counted], -arr.access_size[counted])
        np.add.at(delta, arr.access_op[counted] + 1, arr.access_size[counted])
        np.add.at(delta, arr.first_op[pinned], arr.size[pinned])
        np.add.at(delta, arr.end_op[pinned] + 1, -arr.size[pinned])
    return with_reserve(np.cumsum(delta[:-1]), arr).tolist()


def min_feasible_budget(trace: ActivationTrace) -> int:
    return max(min_resident_bytes(trace), default=0)



def min_resident_bytes_timed(trace: ActivationTrace) -> list[int]:
    """The floor when copies take time, on the wait-free timeline (op k starts at the sum of
    the durations before it).

    A storage is off the device at op ``k`` only once its D2H has finished, and that copy
    cannot start before the storage's last write preceding ``k``. One D2H lane moves at
    most ``bytes ready before t + bandwidth * (start_k - t)`` by ``start_k``, for every
    ``t``; whatever of the movable bytes at ``k`` exceeds that must still be resident. (A
    schedule that makes compute wait gives its copies more time; it pays in wait.)
    """
    from hyperpar.offload.planning.arrays import gap_arrays, resident_without_offload, trace_arrays
    from hyperpar.offload.planning.simulate import ms_per_byte

    floor = min_resident_bytes(trace)
    cost = ms_per_byte(trace.d2h_bandwidth_gbps)
    arr = trace_arrays(trace)
    if arr.num_ops == 0 or cost == 0.0:
        return floor
    base = resident_without_offload(arr)
    end_ms = np.cumsum(arr.duration_ms)
    start_ms = end_ms - arr.duration_ms
    gaps = gap_arrays(arr)
    ready_all = end_ms[gaps.copy_op]
    out = list(floor)
    for k in np.flatnonzero(base > np.asarray(floor)).tolist():
        inside = (gaps.start < k) & (gaps.end > k)
        ready, sizes = ready_all[inside], gaps.size[inside]
        order = np.argsort(ready, kind="stable")
        ready, sizes = ready[order], sizes[order]
        before = np.cumsum(sizes) - sizes  # bytes ready strictly before each entry (ties: upper bound)
        t_now = start_ms[k]
        usable = ready < t_now
        capacity = min(float(sizes[usable].sum()), t_now / cost)
        if usable.any():
            capacity = min(capacity, float((before[usable] + (t_now - ready[usable]) / cost).min()))
        movable = int(base[k]) - floor[k]
        out[k] = floor[k] + max(0, movable - _whole_bytes(capacity))
    return out


def _whole_bytes(capacity: float) -> int:
    """Bytes a lane can move, from a capacity worked out as time over cost: ``(t - ready) / cost``
    can land a hair under the integer that ``ready + bytes * cost <= t`` allows (4.1 - 4.0 over
    0.001 is 99.99999999999964), and truncating it would put the floor above a schedule the
    simulator times exactly. Rounding up within 1e-9 only lowers a lower bound."""
    return math.floor(capacity * (1.0 + 1e-9) + 1e-9)


def min_feasible_budget_timed(trace: ActivationTrace) -> int:
    return max(min_resident_bytes_timed(trace), default=0)


def exposed_wait_lower_bound(trace: ActivationTrace) -> float:
    """Least exposed wait (ms) of any schedule that keeps every op within the budget.

    At an op ``k`` over budget without offload, at least ``X = resident - budget`` bytes of
    storages that live across ``k`` must be off the device while ``k`` runs, so their H2D
    copies start after ``k`` ends. A schedule picks which; at best those read last. Of
    whatever it picks, at least ``X - (bytes read after op m)`` must be back before op
    ``m`` starts, through one H2D lane: if that takes longer than the compute between
    the end of ``k`` and the start of ``m``, compute waits for the difference. Waits of
    disjoint windows ``(k, m]`` add up; the bound is the best sum over disjoint windows
    (a small dynamic program). Storages do not split: if the ones smaller than the bytes
    needed cannot add up to them, a whole larger one comes back. It ignores D2H, lane
    sharing across windows and the other ops' budgets, so it can only be lower than the
    truth. Ops whose excess cannot be moved at all are skipped (no schedule meets the
    budget there).
    """
    from hyperpar.offload.planning.arrays import gap_arrays, resident_without_offload, trace_arrays
    from hyperpar.offload.planning.simulate import ms_per_byte

    cost = ms_per_byte(trace.h2d_bandwidth_gbps)
    arr = trace_arrays(trace)
    n = arr.num_ops
    if n == 0 or cost == 0.0:
        return 0.0
    excess = resident_without_offload(arr) - trace.memory_limit_bytes
    end_ms = np.cumsum(arr.duration_ms)
    start_ms = end_ms - arr.duration_ms
    gaps = gap_arrays(arr)
    windows: dict[int, list[tuple[int, float]]] = {}
    for k in np.flatnonzero(excess > 0).tolist():
        inside = (gaps.start < k) & (gaps.end > k)
        sizes, reads = gaps.size[inside], gaps.end[inside]
        need = int(excess[k])
        if int(sizes.sum()) < need:
            continue
        for m in np.unique(reads).tolist():
            must = need - int(sizes[reads > m].sum())
            if must <= 0:
                continue
            must = _least_cover(sizes[reads <= m], must)

            wait = must * cost - (start_ms[m] - end_ms[k])
            if wait > 0:
                windows.setdefault(m, []).append((k, float(wait)))
    best = [0.0] * (n + 1)  # best[i]: windows within ops < i
    for i in range(n):
        value = best[i]
        for k, wait in windows.get(i, ()):
            value = max(value, best[k + 1] + wait)
        best[i + 1] = max(best[i], value)
    return best[n]


def _least_cover(sizes: np.ndarray, need: int) -> int:
    """A lower bound on the least total of some of ``sizes`` adding up to ``need`` or more."""
    small = sizes[sizes < need]
    if int(small.sum()) >= need:
        return need
    large = sizes[sizes >= need]
    return int(large.min()) if len(large) else need
