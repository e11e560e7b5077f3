"""A model's repeated blocks (its layers), found in a saved trace that has no module calls.

A session sees module calls directly (``capture.tracing.module_spans``); a trace saved to a
file does not keep them. A transformer's forward is its embedding, N copies of one layer's
ops and its head, so the layers are the longest run of the op-name sequence that repeats
with one period: the period is a layer's op count, the run's start its first op.
"""

from __future__ import annotations

import numpy as np

from hyperpar.offload.ir import ActivationTrace

MIN_BLOCK_OPS = 4  # shorter periods are an op pattern (view, mm, view), not a layer


def forward_end_of(trace: ActivationTrace) -> int:
    """The first op of backward: the first op named as a backward one (``*_backward*``), else
    the middle of the step (a model whose backward has no such op)."""
    for i, op in enumerate(trace.ops):
        if "backward" in op.name:
            return i
    return len(trace.ops) // 2


def repeated_blocks(trace: ActivationTrace, forward_end: int) -> list[tuple[int, int]]:
    """The (first op, end op) of each repeated block of forward (ops before ``forward_end``):
    the period and start covering the most ops with two or more identical consecutive blocks
    (the shortest period among equals); [] when nothing repeats."""
    names = [op.name for op in trace.ops[:forward_end]]
    if len(names) < 2 * MIN_BLOCK_OPS:
        return []
    codes = np.unique(np.array(names), return_inverse=True)[1]
    best: tuple[int, int, int, int] | None = None  # (ops covered, period, start, blocks)
    for period in range(MIN_BLOCK_OPS, len(codes) // 2 + 1):
        same = np.concatenate([[0], (codes[:-period] == codes[period:]).astype(np.int8), [0]])
        edges = np.diff(same)
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if not len(starts):
            continue
        k = int(np.argmax(ends - starts))
        blocks = (int(ends[k] - starts[k]) + period) // period
        if blocks >= 2 and (best is None or blocks * period > best[0]):
            best = (blocks * period, period, int(starts[k]), blocks)
    if best is None:
        return []
    _, period, start, blocks = best
    return [(start + k * period, start + (k + 1) * period) for k in range(blocks)]
