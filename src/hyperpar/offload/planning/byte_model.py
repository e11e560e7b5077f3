"""Resident bytes per op when copies take no time: what the greedy planner reasons with."""

from __future__ import annotations

from collections.abc import Iterable

from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.planning.gaps import Gap


def resident_after_evictions(trace: ActivationTrace, chosen: Iterable[Gap]) -> list[int]:
    """No-offload resident bytes minus each chosen gap's size over its inside ops."""
    n = trace.num_ops
    delta = [0] * (n + 1)
    for gap in chosen:
        delta[gap.start + 1] -= gap.size
        delta[gap.end] += gap.size
    out, running = [], 0
    for i, base in enumerate(trace.resident_bytes_without_offload()):
        running += delta[i]
        out.append(base + running)
    return out
