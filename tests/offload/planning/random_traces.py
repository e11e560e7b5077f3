"""Random activation traces for property tests: new outputs, reads, in-place writes,
retained storages, random sizes, durations, bandwidths and budgets."""

from __future__ import annotations

import random

from hyperpar.offload.ir import AccessKind, ActivationTrace, StorageAccess, TraceOp


def random_trace(rng: random.Random, max_ops: int = 24, timed: bool | None = None) -> ActivationTrace:
    n = rng.randint(1, max_ops)
    sizes: dict[int, int] = {}
    ops: list[TraceOp] = []
    for i in range(n):
        accesses: dict[int, AccessKind] = {}
        existing = list(sizes)
        for sid in rng.sample(existing, k=min(len(existing), rng.choice([0, 1, 1, 2, 3]))):
            accesses[sid] = AccessKind.READ
        if existing and rng.random() < 0.25:  # in-place write of an older storage
            accesses[rng.choice(existing)] = AccessKind.WRITE
        for _ in range(rng.choice([0, 1, 1, 1, 2])):
            sid = len(sizes)
            sizes[sid] = rng.choice([1, 8, 64, 100, 500, 1000, 4096])
            accesses[sid] = AccessKind.WRITE
        duration = rng.choice([0.0, 0.1, 0.5, 1.0, 3.0])
        ops.append(TraceOp(f"op{i}", duration, tuple(StorageAccess(i, s, k) for s, k in accesses.items())))
    retained = frozenset(s for s in sizes if rng.random() < 0.15)
    if timed is None:
        timed = rng.random() < 0.7
    # 1000 bytes take ~1 ms at 0.001 GB/s: copies comparable to ops.
    d2h = rng.choice([0.0005, 0.001, 0.004, 0.05]) if timed else 0.0
    h2d = rng.choice([0.0005, 0.001, 0.004, 0.05]) if timed else 0.0
    trace = ActivationTrace(ops, sizes, retained, 0, d2h, h2d)
    peak = trace.peak_bytes_without_offload()
    trace.memory_limit_bytes = int(peak * rng.choice([0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0, 1.2]))
    return trace
