"""A large transformer-shaped trace, for planner speed and scaling checks.

Each layer's forward is a chain of ops, each reading the previous output (sometimes
in place) and the layer input (a residual); about half the outputs are saved for the
backward pass, which walks the layers in reverse reading a gradient and the saved
activations and writing a new gradient plus a retained weight gradient per layer.
Sizes and durations are drawn per op kind: wide GEMM outputs are big and slow-ish,
elementwise outputs small and quick, as on a GPU.
"""

from __future__ import annotations

import random

from hyperpar.offload.ir import AccessKind, ActivationTrace, StorageAccess, TraceOp

MB = 1 << 20
W, R = AccessKind.WRITE, AccessKind.READ


def synthetic_trace(
    num_ops: int = 200_000,
    seed: int = 0,
    budget_fraction: float = 0.5,
    d2h_gbps: float = 50.0,
    h2d_gbps: float = 50.0,
) -> ActivationTrace:
    """Exactly ``num_ops`` ops (the last layer's backward is trimmed, short traces padded)."""
    rng = random.Random(seed)
    ops: list[TraceOp] = []
    sizes: dict[int, int] = {}
    retained: set[int] = set()

    def new(size: int) -> int:
        sid = len(sizes)
        sizes[sid] = size
        return sid

    def add(name: str, ms: float, accesses: dict[int, AccessKind]) -> None:
        i = len(ops)
        ops.append(TraceOp(name, ms, tuple(StorageAccess(i, s, k) for s, k in accesses.items())))

    x = new(8 * MB)
    add("embedding", 0.02, {x: W})
    layers: list[tuple[int, list[int]]] = []
    ops_per_layer = 36
    num_layers = max(1, (num_ops - 2) // ops_per_layer)
    for _ in range(num_layers):
        layer_in, saved, prev = x, [], x
        for j in range(12):
            wide = j in (1, 5, 6)
            if j in (3, 8) and rng.random() < 0.7:  # in-place activation
                add("relu_", 0.01, {prev: W})
                continue
            out = new(rng.choice([16, 32, 64]) * MB if wide else rng.choice([4, 8, 8, 16]) * MB)
            accesses = {prev: R, out: W}
            if j in (4, 11):
                accesses[layer_in] = R
            add("mm" if wide else "pointwise", rng.uniform(0.1, 0.6) if wide else rng.uniform(0.01, 0.08),
                accesses)
            if rng.random() < 0.55:
                saved.append(out)
            prev = out
        layers.append((layer_in, saved))
        x = prev
    loss = new(4)
    add("loss", 0.01, {x: R, loss: W})
    retained.add(loss)
    grad = new(8 * MB)
    add("loss_backward", 0.01, {loss: R, grad: W})
    for layer_in, saved in reversed(layers):
        for k in range(ops_per_layer - 12):
            if len(ops) >= num_ops:
                break
            accesses = {grad: R}
            if saved and k % 2 == 0:
                accesses[saved.pop()] = R
            if k == ops_per_layer - 13:
                accesses[layer_in] = R
                wgrad = new(2 * MB)
                retained.add(wgrad)
                accesses[wgrad] = W
            out = new(rng.choice([4, 8, 8, 16]) * MB)
            accesses[out] = W
            add("backward", rng.uniform(0.02, 0.5), accesses)
            grad = out
    while len(ops) < num_ops:  # pad to the exact count with the optimizer's bookkeeping ops
        add("optimizer", 0.005, {})
    trace = ActivationTrace(ops, sizes, frozenset(retained), 0, d2h_gbps, h2d_gbps)
    trace.memory_limit_bytes = int(trace.peak_bytes_without_offload() * budget_fraction)
    return trace
