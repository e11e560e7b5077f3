"""The greedy covering step shared by both planners, in O(entries + ops log ops).

An entry (an inclusive op range and a size) is taken iff some op in its range is still
over budget, and taking it lowers every op of the range by its size. Bytes only ever go
down, so an op that fits once fits for good: ops still over budget sit in a "next
over-budget op" union-find, and their exact bytes come from a Fenwick tree of the sizes
taken so far, checked lazily when an entry asks.
"""

from __future__ import annotations

import numpy as np


class Covering:
    def __init__(self, resident: np.ndarray, budget: int) -> None:
        n = len(resident)
        self.n = n
        self.budget = budget
        self._base = resident.tolist()
        # nxt[x]: a candidate for the first op >= x still over budget (n: none)
        self._nxt = [*np.where(resident > budget, np.arange(n), np.arange(n) + 1).tolist(), n]
        self._fenwick = [0] * (n + 2)  # bytes taken off: prefix sums over 1-based op + 1

    def _find(self, x: int) -> int:
        nxt = self._nxt
        root = x
        while nxt[root] != root:
            root = nxt[root]
        while nxt[x] != root:
            nxt[x], x = root, nxt[x]
        return root

    def any_over(self) -> bool:
        return self._over_in(0, self.n - 1)

    def _over_in(self, lo: int, hi: int) -> bool:
        if lo > hi:
            return False
        fenwick, base, budget, nxt = self._fenwick, self._base, self.budget, self._nxt
        x = self._find(lo)
        while x <= hi:
            i, freed = x + 1, 0
            while i > 0:
                freed += fenwick[i]
                i -= i & -i
            if base[x] - freed > budget:
                return True
            nxt[x] = x + 1
            x = self._find(x + 1)
        return False

    def try_take(self, lo: int, hi: int, size: int) -> bool:
        if not self._over_in(lo, hi):
            return False
        fenwick, limit = self._fenwick, self.n + 1
        i = lo + 1
        while i <= limit:
            fenwick[i] += size
            i += i & -i
        i = hi + 2
        while i <= limit:
            fenwick[i] -= size
            i += i & -i
        return True


def take_covering(
    resident: np.ndarray, budget: int, lo: np.ndarray, hi: np.ndarray, size: np.ndarray
) -> np.ndarray:
    """Indices of the entries taken, trying them in the given order."""
    if len(resident) == 0 or len(lo) == 0 or int(resident.max()) <= budget:
        return np.zeros(0, dtype=np.int64)
    cover = Covering(resident, budget)
    los, his, sizes = lo.tolist(), hi.tolist(), size.tolist()
    taken: list[int] = []
    next_check = 1
    for k in range(len(los)):
        if not cover.try_take(los[k], his[k], sizes[k]):
            continue
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
