"""A step made of many tiny ops: what warmup, planning, replay and a kept plan cost.

Each layer is ``x = relu(x * w + b)`` on a 64x16 tensor with 16-element weights (about 14
ops a layer, forward and backward), so an op does almost no work and the per-op overhead
of the session is all there is to see. Reports CPU seconds (process time, one torch thread)
of a plain step, the same step under a do-nothing TorchDispatchMode (the floor any
dispatch-mode interception pays), the warmup step, planning (the session's own
``_plan``: planner, simulation, replay program), and a replay step; and the bytes the kept
plan holds (trace + schedule + replay program, by ``tracemalloc`` in a separate session so
tracing does not slow the timed one) per storage access of the trace.

    .venv/bin/python benchmarks/tiny_ops.py --layers 30000 --out hyperpar-bench/tiny_ops.json
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch

from hyperpar.bench.headlines import write
from hyperpar.bench.offload import PassThrough  # the do-nothing dispatch mode
from hyperpar.bench.result_file import provenance
from hyperpar.offload import OffloadConfig, OffloadSession


def _model(layers: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    ws = [torch.randn(16, generator=g).requires_grad_() for _ in range(layers)]
    bs = [torch.randn(16, generator=g).requires_grad_() for _ in range(layers)]
    return x, ws, bs


def _step(x: torch.Tensor, ws: list[torch.Tensor], bs: list[torch.Tensor]) -> None:
    for w, b in zip(ws, bs, strict=True):
        x = torch.relu(x * w + b)
    x.sum().backward()
    for p in ws + bs:
        p.grad = None


def _cpu(fn: Any) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def measure(layers: int, budget_fraction: float, replays: int, skip_replay: bool = False) -> dict[str, Any]:
    torch.set_num_threads(1)
    with OffloadSession(OffloadConfig(max_resident_fraction=budget_fraction)):  # imports done lazily
        _step(*_model(2))
    x, ws, bs = _model(layers)
    plain = min(_cpu(lambda: _step(x, ws, bs)) for _ in range(2))

    def intercepted() -> None:
        with PassThrough():
            _step(x, ws, bs)

    floor = min(_cpu(intercepted) for _ in range(2))  # what any TorchDispatchMode costs here
    session = OffloadSession(OffloadConfig(max_resident_fraction=budget_fraction))
    planning: list[float] = []
    plan = session._plan

    def timed_plan(*args: Any, **kwargs: Any) -> Any:
        t0 = time.process_time()
        try:
            return plan(*args, **kwargs)
        finally:
            planning.append(time.process_time() - t0)

    session._plan = timed_plan  # type: ignore[method-assign]

    def in_session(s: OffloadSession = session) -> None:
        with s:
            _step(x, ws, bs)

    warmup_and_plan = _cpu(in_session)
    assert session.trace is not None
    trace = session.trace
    ops = len(trace.ops)
    accesses = sum(len(op.accesses) for op in trace.ops)
    warmup = warmup_and_plan - planning[0]
    if skip_replay:  # warmup and planning only: side-by-side planning runs in a minute or two
        return {"layers": layers, "ops": ops, "accesses": accesses, "budget_fraction": budget_fraction,
                "plain_cpu_s": plain, "passthrough_cpu_s": floor, "passthrough_over_plain": floor / plain,
                "warmup_cpu_s": warmup, "planning_cpu_s": planning[0], "warmup_over_plain": warmup / plain}
    replay = [_cpu(in_session) for _ in range(replays)]
    assert session.last_report is not None and session.last_report.diverged_at is None

    # The kept plan's bytes, in a session of its own (tracemalloc slows everything it sees).
    del session, trace
    gc.collect()
    kept_session = OffloadSession(OffloadConfig(max_resident_fraction=budget_fraction))
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    with kept_session:
        _step(x, ws, bs)
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {
        "layers": layers, "ops": ops, "accesses": accesses, "budget_fraction": budget_fraction,
        "plain_cpu_s": plain, "passthrough_cpu_s": floor, "passthrough_over_plain": floor / plain,
        "warmup_cpu_s": warmup, "planning_cpu_s": planning[0],
        "replay_cpu_s": min(replay),
        "warmup_over_plain": warmup / plain, "replay_over_plain": min(replay) / plain,
        "kept_plan_bytes": kept, "kept_plan_bytes_per_access": kept / accesses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30_000,
                        help="layers of about 14 tiny ops each (default 30000)")
    parser.add_argument("--budget-fraction", type=float, default=0.5)
    parser.add_argument("--replays", type=int, default=2)
    parser.add_argument("--skip-replay", action="store_true",
                        help="stop after planning: no replay steps, no kept-plan bytes")
    parser.add_argument("--out", type=Path, default=Path("hyperpar-bench/tiny_ops.json"))
    args = parser.parse_args()
    started = provenance([".venv/bin/python", "benchmarks/tiny_ops.py", *sys.argv[1:]])
    result = measure(args.layers, args.budget_fraction, args.replays, args.skip_replay)
    result.update(torch=torch.__version__, machine=platform.machine(), python=platform.python_version(),
                  load_average=list(__import__("os").getloadavg()),
                  command=" ".join([".venv/bin/python", "benchmarks/tiny_ops.py", *sys.argv[1:]]))
    write("tiny_ops", args.out, result, started, indent=2)
    for key, value in result.items():
        print(f"{key:28} {value:.3f}" if isinstance(value, float) else f"{key:28} {value}")


if __name__ == "__main__":
    main()
