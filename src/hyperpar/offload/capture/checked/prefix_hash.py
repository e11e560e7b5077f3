"""Per-op prefix hashes of a replay program, computed on whole columns with numpy.

``prefix[i]`` stands for ops ``0..i`` as replay checks them (op key, input sids, output
bindings, output dtypes and ranks, an opaque region's accesses): two programs of this
process whose ``prefix[i]`` agree ran the same ops up to ``i`` (up to a 64-bit hash
collision). A Python ``hash`` of a tuple per op took a second for 300k ops; this is a
polynomial rolling hash over mixed per-op hashes, in wrapping uint64 arithmetic.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

_P = 0x9E3779B97F4A7C15  # odd: invertible modulo 2**64
_P_INV = pow(_P, -1, 1 << 64)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit reaches every output bit."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def _u64(values: Any) -> np.ndarray:
    return np.array(values, dtype=np.int64).view(np.uint64)


def _segments(start: array, *columns: array) -> np.ndarray:
    """One hash per op of its ragged segment ``columns[*][start[i]:start[i+1]]``, order-aware."""
    bounds = np.array(start, dtype=np.int64)
    counts = np.diff(bounds)
    total = int(bounds[-1]) if len(bounds) else 0
    element = np.zeros(total, dtype=np.uint64)
    for c, column in enumerate(columns):
        element = _mix(element + _u64(column) + np.uint64(c + 1))
    position = np.arange(total, dtype=np.int64) - np.repeat(bounds[:-1], counts)
    element = _mix(element ^ position.view(np.uint64))
    cumulative = np.concatenate((np.zeros(1, dtype=np.uint64), np.cumsum(element, dtype=np.uint64)))
    return (cumulative[bounds[1:]] - cumulative[bounds[:-1]]) ^ _mix(counts.view(np.uint64))


def key_hashes(keys: Sequence[Any]) -> list[int]:
    """``hash`` of each key, computed once per distinct key (by identity): an OpOverload's
    ``__hash__`` is Python code, ~1 µs a call, and a trace repeats a few dozen ops."""
    ids = list(map(id, keys))
    once = {i: hash(k) for i, k in dict(zip(ids, keys, strict=True)).items()}
    return list(map(once.__getitem__, ids))


def prefix_hashes(keys: Sequence[Any], in_start: array, in_sid: array, bind_start: array, bind_leaf: array,
                  bind_sid: array, meta_hash: Sequence[int], region_hash: dict[int, int]) -> array:
    n = len(keys)
    if n == 0:
        return array("q")
    op = _u64(key_hashes(keys))
    for part in (_segments(in_start, in_sid), _segments(bind_start, bind_leaf, bind_sid), _u64(meta_hash)):
        op = _mix(op ^ part) + np.uint64(1)
    if region_hash:
        where = np.fromiter(region_hash, dtype=np.int64, count=len(region_hash))
        op[where] = _mix(op[where] ^ _u64(list(region_hash.values())))
    # prefix[i] = sum_j op[j] * P**(i - j) = P**i * cumsum(op[j] * P**-j), all modulo 2**64
    powers = np.cumprod(np.full(n, _P, dtype=np.uint64), dtype=np.uint64)
    inverse = np.concatenate((np.ones(1, dtype=np.uint64),
                              np.cumprod(np.full(n - 1, _P_INV, dtype=np.uint64), dtype=np.uint64)))
    prefix = powers * np.cumsum(_mix(op) * inverse, dtype=np.uint64)
    out = array("q")
    out.frombytes(prefix.view(np.int64).tobytes())
    return out
