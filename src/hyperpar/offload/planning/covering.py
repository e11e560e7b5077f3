"""The greedy covering step shared by both planners, in O(entries + ops log ops).

Entries are tried in the given order; one is taken iff some op in its inclusive range
``[lo, hi]`` is still over budget, and taking it lowers every op of the range by its
size. Bytes only ever go down, so an op that fits once fits for good: ops still over
budget sit in a "next over-budget op" union-find, and their exact bytes come from a
Fenwick tree of the sizes taken so far, checked lazily when an entry asks.
"""

from __future__ import annotations

import numpy as np


def take_covering(
    resident: np.ndarray, budget: int, lo: np.ndarray, hi: np.ndarray, size: np.ndarray
) -> np.ndarray:
    """Indices of the entries taken, in order."""
    n = len(resident)
    if n == 0 or len(lo) == 0 or int(resident.max()) <= budget:
        return np.zeros(0, dtype=np.int64)
    base = resident.tolist()
    los, his, sizes = lo.tolist(), hi.tolist(), size.tolist()
    # nxt[x]: a candidate for the first op >= x still over budget (n: none)
    nxt = [*np.where(resident > budget, np.arange(n), np.arange(n) + 1).tolist(), n]
    fenwick = [0] * (n + 2)  # bytes taken off: prefix sums over 1-based op + 1

    def find(x: int) -> int:
        root = x
        while nxt[root] != root:
            root = nxt[root]
        while nxt[x] != root:
            nxt[x], x = root, nxt[x]
        return root

    taken: list[int] = []
    next_check = 1
    for k in range(len(los)):
        a, b = los[k], his[k]
        x = find(a) if a <= b else n
        hit = False
        while x <= b:
            i, freed = x + 1, 0
            while i > 0:
                freed += fenwick[i]
                i -= i & -i
            if base[x] - freed > budget:
                hit = True
                break
            nxt[x] = x + 1
            x = find(x + 1)
        if not hit:
            continue
        z = sizes[k]
        i = a + 1
        while i <= n + 1:
            fenwick[i] += z
            i += i & -i
        i = b + 2
        while i <= n + 1:
            fenwick[i] -= z
            i += i & -i
        taken.append(k)
        if len(taken) >= next_check:  # exact check now and then; stopping early changes nothing
            next_check *= 2
            if int(relieve(resident, lo, hi, size, np.asarray(taken)).max()) <= budget:
                break
    return np.asarray(taken, dtype=np.int64)


def relieve(resident: np.ndarray, lo: np.ndarray, hi: np.ndarray, size: np.ndarray,
            which: np.ndarray) -> np.ndarray:
    """``resident`` minus ``size[k]`` over ``[lo[k], hi[k]]`` for each k in ``which``."""
    n = len(resident)
    lo, hi, size = lo[which], hi[which], size[which]
    keep = hi >= lo
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, lo[keep], -size[keep])
    np.add.at(delta, hi[keep] + 1, size[keep])
    return resident + np.cumsum(delta[:-1])
