"""Sorted distinct storage ids, shared by the planners' trace arrays and the replay program."""

from __future__ import annotations

import numpy as np


def sorted_distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique`` by sorting (numpy's hash-based ``unique`` is several times slower on ids)."""
    s = np.sort(values)
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if len(s) else s
