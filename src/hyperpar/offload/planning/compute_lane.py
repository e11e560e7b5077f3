"""The simulator's compute lane: when each op starts and ends, visiting only the ops that matter.

Ops run back to back except where one waits for a copy. Between waits an op's start is a
running sum of the durations since the last wait; numpy's ``cumsum`` adds in order, one
element after another, exactly as a Python loop would (bitwise the same), so the simulator
only visits, in Python, the ops that issue actions or may wait. Sums are taken lazily in
growing chunks from each wait on, so many waits cost no more than one pass.
"""

from __future__ import annotations

import numpy as np

_FIRST_CHUNK = 64


class ComputeLane:
    def __init__(self, durations: np.ndarray) -> None:
        self._d = np.ascontiguousarray(durations, dtype=np.float64)
        self._n = len(self._d)
        self._starts: list[float] = []  # of the ops before the current run
        self._ends: list[float] = []
        self._base = 0  # first op of the current run (since the last wait)
        self._sums = [0.0]  # _sums[k]: start of op _base + k, were it not to wait; end of the op before

    def _extend(self, k: int) -> list[float]:
        """The current run's sums, through index ``k`` at least."""
        sums = self._sums
        have = len(sums)
        room = self._n - self._base + 1 - have
        grow = min(room, max(k + 1 - have, have, _FIRST_CHUNK))
        first = self._base + have - 1
        more = np.empty(grow + 1, dtype=np.float64)
        more[0] = sums[-1]
        more[1:] = self._d[first:first + grow]
        sums.extend(np.cumsum(more)[1:].tolist())
        return sums

    def before(self, i: int) -> float:
        """The end of op ``i - 1`` (0 for the first op): when op ``i`` may start."""
        k = i - self._base
        sums = self._sums
        return sums[k] if k < len(sums) else self._extend(k)[k]

    def after(self, i: int) -> float:
        """The end of op ``i`` (``i`` at or after the last wait)."""
        k = i - self._base + 1
        sums = self._sums
        return sums[k] if k < len(sums) else self._extend(k)[k]

    def _close(self, stop: int) -> None:
        """Keep the starts and ends of the current run's ops before ``stop``."""
        k = stop - self._base
        sums = self._sums if k < len(self._sums) else self._extend(k)
        self._starts += sums[:k]
        self._ends += sums[1:k + 1]

    def wait(self, i: int, start: float) -> None:
        """Op ``i`` starts at ``start``, later than ``before(i)``: a new run begins."""
        self._close(i)
        self._base = i
        self._sums = [start]

    def finish(self) -> tuple[list[float], list[float]]:
        """(start, end) of every op."""
        self._close(self._n)
        return self._starts, self._ends
