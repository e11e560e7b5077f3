"""Step time of a torch.compile'd GPT inside an OffloadSession, side by side with plain runs.

Four variants of the package's GPT (every block ``torch.compile``'d, the rest eager), each
its own copy from the same initial weights, timed in one process with their steps
interleaved (rotating order) so the machine's load affects all alike:

- ``eager``: no compile, no session;
- ``compiled``: compiled blocks, no session (the reference for the ratios);
- ``session_peak``: compiled blocks in a session whose budget is the activation peak;
- ``session_50``: compiled blocks in a session at 50 % of the peak.

Reports the median wall and CPU time per step and each ratio to ``compiled``; writes
``hyperpar-bench/compile.json`` with machine, torch and command (``--out
benchmarks/results/compile.json`` updates the committed one).

    python benchmarks/compile_in_session.py                    # small GPT, inductor
    python benchmarks/compile_in_session.py --quick            # tiny, a few steps (smoke test)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hyperpar.bench.headlines import write
from hyperpar.bench.result_file import provenance
from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession

MIB = 1 << 20
VARIANTS = ("eager", "compiled", "session_peak", "session_50")


def _model(cfg: GPTConfig, backend: str | None) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(cfg)
    if backend is not None:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend)
    return model


def _step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], session: OffloadSession | None) -> None:
    idx, targets = batch
    model.zero_grad(set_to_none=True)
    if session is None:
        nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()
    else:
        with session:
            nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()


def measure(quick: bool, steps: int, backend: str, batch_size: int) -> dict[str, Any]:
    cfg = GPTConfig.tiny() if quick else GPTConfig.small()
    batch = random_batch(cfg, batch_size, torch.Generator().manual_seed(0))
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e9))
    probe_model = _model(cfg, backend)
    for _ in range(2):
        _step(probe_model, batch, probe)
    peak = probe.last_report.peak_resident_bytes
    sessions = {"session_peak": OffloadSession(OffloadConfig(max_resident_activation_mb=peak / MIB)),
                "session_50": OffloadSession(OffloadConfig(max_resident_activation_mb=0.5 * peak / MIB))}
    models = {name: _model(cfg, None if name == "eager" else backend) for name in VARIANTS}
    for name in VARIANTS:  # compile, trace, plan, first replay: not timed
        for _ in range(3):
            _step(models[name], batch, sessions.get(name))
    wall: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for i in range(steps):
        order = VARIANTS[i % len(VARIANTS):] + VARIANTS[:i % len(VARIANTS)]
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            _step(models[name], batch, sessions.get(name))
            wall[name].append((time.perf_counter() - t0) * 1e3)
            cpu[name].append((time.process_time() - c0) * 1e3)
    ref_wall, ref_cpu = statistics.median(wall["compiled"]), statistics.median(cpu["compiled"])
    out: dict[str, Any] = {"model": {"config": cfg.__dict__, "batch": batch_size}, "backend": backend,
                           "activation_peak_bytes": peak, "steps": steps, "variants": {}}
    for name in VARIANTS:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        entry: dict[str, Any] = {"wall_ms": w, "cpu_ms": c, "wall_ratio_to_compiled": w / ref_wall,
                                 "cpu_ratio_to_compiled": c / ref_cpu, "wall_ms_all": wall[name]}
        session = sessions.get(name)
        if session is not None:
            r = session.last_report
            entry.update(phase=r.phase, diverged_at=r.diverged_at, peak_resident_bytes=r.peak_resident_bytes,
                         budget_bytes=r.budget_bytes, bytes_d2h=r.bytes_d2h, demand_faults=r.demand_faults)
        out["variants"][name] = entry
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny GPT, few steps (smoke test)")
    parser.add_argument("--steps", type=int, default=None, help="interleaved rounds (default 12; quick 2)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 16; quick 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--out", type=Path, default=Path("hyperpar-bench/compile.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = provenance()
    steps = args.steps if args.steps is not None else (2 if args.quick else 12)
    batch = args.batch if args.batch is not None else (2 if args.quick else 16)
    t0 = time.perf_counter()
    result = measure(args.quick, steps, args.backend, batch)
    doc = {"benchmark": "compile_in_session", "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "torch": torch.__version__, "load_avg_at_start": os.getloadavg(),
           "machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()},
           **result, "wall_s": time.perf_counter() - t0}
    print(f"GPT {result['model']['config']} batch {batch}, backend {args.backend}, "
          f"{steps} interleaved rounds, activation peak {result['activation_peak_bytes'] / MIB:.2f} MiB")
    ratio = "x compiled"
    print(f"{'variant':14s} {'wall ms':>9s} {ratio:>10s} {'cpu ms':>9s} {ratio:>10s} {'MiB d2h':>8s}")
    for name, r in result["variants"].items():
        moved = f"{r['bytes_d2h'] / MIB:8.2f}" if "bytes_d2h" in r else f"{'-':>8s}"
        print(f"{name:14s} {r['wall_ms']:9.2f} {r['wall_ratio_to_compiled']:10.3f} {r['cpu_ms']:9.2f} "
              f"{r['cpu_ratio_to_compiled']:10.3f} {moved}")
    write("compile", args.out, doc, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
