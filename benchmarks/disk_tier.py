"""The disk tier on the demo's GPT at a large batch (issue 42): step time with the host budget a
quarter of what a step moves, against host-only offload without a host budget and plain.

One process, one torch thread; plain, host-only offload (``max_resident_fraction``), the
disk tier (the same device budget, ``max_host_activation_mb`` = ``--host-share`` of the bytes
a host-only replay moves, ``disk_dir`` a temporary folder of ``--dir``) and the same tier on
its online policy without the plan's disk plan (the ablation, ``planned_over_online``) take
turns step by step on four copies of the model; their losses must be bitwise equal. Then each offload
run goes on alone for ``--rss-steps`` steps with the process's peak RSS reset before it
(``/proc/self/clear_refs``), so the peak host memory of each stands side by side. The raw
bandwidth of the same disk is measured as ``benchmarks/disk_store.py`` does (8 MiB
``O_DIRECT`` transfers of 1 GiB, the median of three: this virtual disk's figure moves by 1.5x
between runs).

    .venv/bin/python benchmarks/disk_tier.py --out benchmarks/results/disk_tier.json
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hyperpar.bench import headlines
from hyperpar.bench.result_file import provenance
from hyperpar.demo.dense import DemoSpec, measure_activation_peak
from hyperpar.models import GPT, GPTConfig
from hyperpar.offload import OffloadConfig, OffloadSession

MIB = 1 << 20
# glibc: every allocation of 128 KiB or more its own mapping, given back when freed (by default
# the threshold grows with the largest block freed, and freed heap memory stays in the RSS): so a
# run's RSS follows the bytes it holds, not what the allocator kept from earlier peaks
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10), "MALLOC_TRIM_THRESHOLD_": str(128 << 10)}
SIZES = {"tiny": GPTConfig.tiny, "small": GPTConfig.small, "medium": GPTConfig.medium}


def _raw_gbps(directory: str, total: int) -> tuple[float, float, bool]:
    """``benchmarks/disk_store.py``'s raw measure (a sibling script, not a package)."""
    path = Path(__file__).with_name("disk_store.py")
    spec = importlib.util.spec_from_file_location("disk_store_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.raw_gbps(directory, total)


def _rss_peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class _Run:
    def __init__(self, spec: DemoSpec, session: OffloadSession | None) -> None:
        self.model: GPT = spec.build_model()
        self.session = session
        self.wall_ms: list[float] = []
        self.losses: list[torch.Tensor] = []
        self.reports: list[dict[str, Any]] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        t0 = time.perf_counter()
        if self.session is None:
            loss = self.model.loss(x, y)
            loss.backward()
        else:
            with self.session:
                loss = self.model.loss(x, y)
                loss.backward()
        for p in self.model.parameters():
            p.grad = None
        self.wall_ms.append((time.perf_counter() - t0) * 1e3)
        self.losses.append(loss.detach())
        if self.session is not None and self.session.last_report is not None:
            self.reports.append(self.session.last_report.as_dict())


def _steady(values: list[float], settle: int) -> dict[str, float]:
    v = values[settle:]
    return {"median": statistics.median(v), "min": min(v), "max": max(v)}


def measure(args: argparse.Namespace, directory: str) -> dict[str, Any]:
    spec = DemoSpec(cfg=SIZES[args.size](), batch_size=args.batch_size, seed=0, device=torch.device("cpu"))
    peak = measure_activation_peak(spec)
    device_mb = peak.budget(args.budget_fraction) / MIB
    host_only = OffloadSession(OffloadConfig(max_resident_activation_mb=device_mb))
    batches = spec.batches(args.steps + 2)
    probe = _Run(spec, host_only)
    for x, y in batches[:2]:  # warmup and a replay: the bytes a replay moves
        probe.step(x, y)
    moved = probe.reports[-1]["bytes_d2h"]
    host_mb = args.host_share * moved / MIB
    tiered = OffloadConfig(max_resident_activation_mb=device_mb, max_host_activation_mb=host_mb,
                           disk_dir=directory)
    disk, online = OffloadSession(tiered), OffloadSession(tiered)
    online._disk_plans = False  # the ablation: the tier's online policy, no disk plan
    runs = {"plain": _Run(spec, None), "host_only": probe, "disk": _Run(spec, disk),
            "disk_online": _Run(spec, online)}
    probe.wall_ms.clear()
    probe.losses.clear()
    probe.reports.clear()
    plain_losses = []
    for i, (x, y) in enumerate(tqdm(batches[:args.steps], desc="side by side", unit="step")):
        for run in runs.values():
            run.step(x, y)
        plain_losses.append(runs["plain"].losses[i])
    bitwise = all(torch.equal(runs["plain"].losses[i], r.losses[i]) for r in runs.values()
                  for i in range(args.steps))
    disk_reports = runs["disk"].reports
    steady = disk_reports[args.settle:]
    to_disk = sum(r["bytes_to_disk"] for r in steady)
    from_disk = sum(r["bytes_from_disk"] for r in steady)
    write_ms = sum(r["disk_write_ms"] for r in steady)
    read_ms = sum(r["disk_read_ms"] for r in steady)
    ratios = {name: [w / p for w, p in zip(r.wall_ms, runs["plain"].wall_ms, strict=True)]
              for name, r in runs.items() if name != "plain"}
    disk_over_host = [d / h for d, h in zip(runs["disk"].wall_ms, runs["host_only"].wall_ms, strict=True)]
    planned_over_online = [d / o for d, o in zip(runs["disk"].wall_ms, runs["disk_online"].wall_ms,
                                                 strict=True)]
    online_steady = runs["disk_online"].reports[args.settle:]
    online_mib = {way: sum(r[f"bytes_{way}"] for r in online_steady) / MIB / len(online_steady)
                  for way in ("to_disk", "from_disk")}
    extra_ms = [d - h for d, h in zip(runs["disk"].wall_ms, runs["host_only"].wall_ms, strict=True)]
    timed = _timed_estimate(disk, host_mb, to_disk, from_disk, write_ms, read_ms)
    disk.close()
    online.close()
    rss = {name: _in_fresh_process(args, device_mb, host_mb if name == "disk" else None, directory)
           for name in ("host_only", "disk")}
    disk.close()
    raws = [_raw_gbps(directory, args.raw_mib * MIB) for _ in range(args.raw_repeats)]  # a virtual disk
    raw_w, raw_r = statistics.median(r[0] for r in raws), statistics.median(r[1] for r in raws)  # varies
    direct = all(r[2] for r in raws)
    write_gbps = to_disk / (write_ms * 1e6) if write_ms else 0.0
    read_gbps = from_disk / (read_ms * 1e6) if read_ms else 0.0
    return {
        "benchmark": "disk_tier",
        "model": {"size": args.size, "batch_size": args.batch_size, "config": vars(spec.cfg)},
        "steps": args.steps, "settle": args.settle,
        "device_budget_mib": device_mb, "budget_fraction": args.budget_fraction,
        "moved_per_step_mib": moved / MIB, "host_budget_mib": host_mb, "host_share": args.host_share,
        "bitwise": bitwise,
        "wall_ms": {name: r.wall_ms for name, r in runs.items()},
        "steady_over_plain": {name: _steady(v, args.settle) for name, v in ratios.items()},
        "disk_over_host_only": _steady(disk_over_host, args.settle),
        # the disk plan against the tier's online policy (the same budgets, step by step)
        "planned_over_online": _steady(planned_over_online, args.settle),
        "online_per_step_mib": online_mib,
        "disk_paths": [r.get("replay_path") or r["phase"] for r in disk_reports],
        "per_step_mib": {"to_disk": to_disk / MIB / len(steady), "from_disk": from_disk / MIB / len(steady)},
        "io": {"write_gbps": write_gbps, "read_gbps": read_gbps, "raw_write_gbps": raw_w,
               "raw_read_gbps": raw_r, "direct": direct, "raw_runs": [r[:2] for r in raws],
               "write_over_raw": write_gbps / raw_w if raw_w else 0.0,
               "read_over_raw": read_gbps / raw_r if raw_r else 0.0},
        "rss_steps": args.rss_steps, "host_memory": rss,
        # the estimate timed on the disk run's last plan at the bandwidths its tier reached, against
        # the wall time the disk run took over host-only, step by step (steady steps' median)
        "timed_estimate": {**timed, "measured_extra_ms": _steady(extra_ms, args.settle)},
    }


def _timed_estimate(session: OffloadSession, host_mb: float, to_disk: int, from_disk: int,
                    write_ms: float, read_ms: float) -> dict[str, Any]:
    from hyperpar.offload.planning import simulate
    from hyperpar.offload.planning.host_tier import host_tier

    plan = session._current
    assert plan is not None
    trace, schedule = plan.trace, plan.schedule
    write = to_disk / (write_ms * 1e6) if write_ms else 1.0
    read = from_disk / (read_ms * 1e6) if read_ms else 1.0
    sim = simulate(trace, schedule)
    est = host_tier(trace, schedule, int(host_mb * MIB), write, read, timeline=sim)
    online = host_tier(trace, schedule, int(host_mb * MIB), write, read, timeline=sim, disk_plan=False)
    return {"disk_wait_ms": est.disk_wait_ms, "online_disk_wait_ms": online.disk_wait_ms,
            "online_bytes_to_disk": online.bytes_to_disk, "room_ms": est.disk_wait_room_ms,
            "read_ahead_ms": est.disk_wait_read_ahead_ms, "on_demand_ms": est.disk_wait_on_demand_ms,
            "plan_step_ms": est.step_ms, "write_gbps": write,
            "read_gbps": read, "bytes_to_disk": est.bytes_to_disk, "bytes_from_disk": est.bytes_from_disk}


def _rss_steps(size: str, batch_size: int, device_mb: float, host_mb: float | None, directory: str,
               steps: int) -> dict[str, Any]:
    """In a fresh process: ``steps`` steps of one offload run, its peak RSS and host bytes."""
    torch.set_num_threads(1)
    spec = DemoSpec(cfg=SIZES[size](), batch_size=batch_size, seed=0, device=torch.device("cpu"))
    config = (OffloadConfig(max_resident_activation_mb=device_mb) if host_mb is None else
              OffloadConfig(max_resident_activation_mb=device_mb, max_host_activation_mb=host_mb,
                            disk_dir=directory))
    run = _Run(spec, OffloadSession(config))
    batches = spec.batches(4)
    start_mib = _rss_peak_mib()
    for j in range(steps):
        run.step(*batches[j % len(batches)])
    assert run.session is not None
    run.session.close()
    return {"peak_rss_mib": _rss_peak_mib(), "rss_before_steps_mib": start_mib,
            "peak_host_mib": max(r["peak_host_bytes"] for r in run.reports) / MIB,
            "over_device_budget_steps": sum(r["overshoot_bytes"] > 0 for r in run.reports),
            "paths": _count(r.get("replay_path") or r["phase"] for r in run.reports)}


def _in_fresh_process(args: argparse.Namespace, device_mb: float, host_mb: float | None,
                      directory: str) -> dict[str, Any]:
    """Each run's peak RSS from a process of its own: memory another run left in the
    allocator's caches would count otherwise."""
    saved = {k: os.environ.get(k) for k in MALLOC_ENV}
    os.environ.update(MALLOC_ENV)  # read by the new process's allocator at its start
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(_rss_steps, args.size, args.batch_size, device_mb, host_mb, directory,
                               args.rss_steps).result()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="side-by-side steps (default 10)")
    p.add_argument("--settle", type=int, default=3, help="steps left out of the headline (default 3)")
    p.add_argument("--budget-fraction", type=float, default=0.5,
                   help="device budget, share of the movable peak (default 0.5)")
    p.add_argument("--host-share", type=float, default=0.25, help="host budget, share of the bytes moved")
    p.add_argument("--rss-steps", type=int, default=50)
    p.add_argument("--raw-mib", type=int, default=1024, help="bytes of the raw disk measure (default 1 GiB)")
    p.add_argument("--raw-repeats", type=int, default=3, help="raw measures, median taken (default 3)")
    p.add_argument("--dir", default=None, help="where the disk tier's file goes (default: the temp folder)")
    p.add_argument("--out", default="hyperpar-bench/disk_tier.json")
    args = p.parse_args(argv)
    if args.settle >= args.steps:
        p.error(f"--settle ({args.settle}) must be below --steps ({args.steps})")
    started = provenance()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            doc = measure(args, directory)
    finally:
        torch.set_num_threads(threads)
    headlines.write("disk_tier", args.out, doc, started)
    s, io, mem = doc["steady_over_plain"], doc["io"], doc["host_memory"]
    print(f"moved {doc['moved_per_step_mib']:.1f} MiB a step, host budget {doc['host_budget_mib']:.1f} MiB; "
          f"bitwise {doc['bitwise']}")
    print(f"step over plain: host only {s['host_only']['median']:.2f}x, disk tier "
          f"{s['disk']['median']:.2f}x; disk / host only {doc['disk_over_host_only']['median']:.2f}x; "
          f"disk plan / online policy {doc['planned_over_online']['median']:.3f}x")
    per = doc["per_step_mib"]
    online = doc["online_per_step_mib"]
    print(f"disk per step: {per['to_disk']:.1f} MiB out, {per['from_disk']:.1f} MiB in (online policy "
          f"{online['to_disk']:.1f} / {online['from_disk']:.1f}); I/O "
          f"{io['write_gbps']:.2f} / {io['read_gbps']:.2f} GB/s against raw {io['raw_write_gbps']:.2f} / "
          f"{io['raw_read_gbps']:.2f} GB/s")
    for name, m in mem.items():
        print(f"{name}: peak RSS {m['peak_rss_mib']:.0f} MiB, peak host {m['peak_host_mib']:.1f} MiB over "
              f"{doc['rss_steps']} steps, paths {m['paths']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
