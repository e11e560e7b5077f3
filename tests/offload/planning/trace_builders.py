"""Small helpers to write traces by hand in planner tests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hyperpar.offload.ir import AccessKind, ActivationTrace, ResidencyActionType, StorageAccess, TraceOp

# An op is a string like "w1 r2" (write storage 1, read storage 2), optionally (text, ms).
OpSpec = str | tuple[str, float]


def make_trace(
    ops: Sequence[OpSpec],
    sizes: dict[int, int],
    budget: int,
    retained: Iterable[int] = (),
    d2h_gbps: float = 0.0,
    h2d_gbps: float = 0.0,
) -> ActivationTrace:
    trace_ops = []
    for i, spec in enumerate(ops):
        text, ms = (spec, 1.0) if isinstance(spec, str) else spec
        accesses = []
        for token in text.split():
            kind = AccessKind.WRITE if token[0] == "w" else AccessKind.READ
            accesses.append(StorageAccess(i, int(token[1:]), kind))
        trace_ops.append(TraceOp(f"op{i}", ms, tuple(accesses)))
    return ActivationTrace(
        ops=trace_ops, storage_sizes=dict(sizes), retained_sids=frozenset(retained),
        memory_limit_bytes=budget, d2h_bandwidth_gbps=d2h_gbps, h2d_bandwidth_gbps=h2d_gbps,
    )


def actions_text(acts: list) -> list[str]:
    short = {
        ResidencyActionType.COPY_D2H: "d2h",
        ResidencyActionType.COPY_H2D: "h2d",
        ResidencyActionType.RELEASE_DEVICE: "free",
        ResidencyActionType.RELEASE_HOST: "freehost",
    }
    return [f"{short[a.kind]} {a.storage_id}" for a in acts]
