"""``hyperpar plan TRACE.json``: plan a saved trace, print the figures and draw the plots
(with ``--device``, also the projected GPU step: ``plan_projection``; with ``--host-budget-mb``,
the three tiers a disk tier would give the plan: ``planning.host_tier``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hyperpar.commands import plan_projection
from hyperpar.commands.flags import non_negative, positive
from hyperpar.offload.planning.host_tier import DEFAULT_READ_GBPS, DEFAULT_WRITE_GBPS

if TYPE_CHECKING:
    from hyperpar.offload.planning.host_tier import HostTierEstimate

MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace JSON saved by session.trace.save(path)")
    parser.add_argument("--budget-mb", default=None,
                        help="device budget for activations in MiB (default: the trace's own budget)")
    parser.add_argument("--planner", choices=("timed", "greedy"), default="timed")
    parser.add_argument("--sweep", action="store_true",
                        help="also plan budgets from 10%% to 100%% of the peak with both planners")
    parser.add_argument("--out", default="hyperpar_plan",
                        help="folder for the PNG plots (default: %(default)s)")
    parser.add_argument("--host-budget-mb", default=None, metavar="MB",
                        help="host budget for the copies off the device in MiB, as "
                             "OffloadConfig(max_host_activation_mb=...): also show the three tiers "
                             "(device, host, disk) a disk tier would give the plan and whether its I/O "
                             "hides under the step's compute")
    parser.add_argument("--disk-write-gbps", default=None, metavar="GBPS",
                        help=f"with --host-budget-mb: disk write bandwidth in GB/s (default "
                             f"{DEFAULT_WRITE_GBPS:g}, benchmarks/results/disk_store.json, raw O_DIRECT)")
    parser.add_argument("--disk-read-gbps", default=None, metavar="GBPS",
                        help=f"with --host-budget-mb: disk read bandwidth in GB/s (default "
                             f"{DEFAULT_READ_GBPS:g}, same file)")
    plan_projection.add_arguments(parser)


def _budget_bytes(text: str | None, default: int) -> int:
    return default if text is None else int(non_negative("plan", "--budget-mb", text, "MiB") * MIB)


def _tier_flags(args: argparse.Namespace) -> tuple[int, float, float] | None:
    """The host budget in bytes and the disk bandwidths, checked; None without --host-budget-mb."""
    write = None if args.disk_write_gbps is None else positive("plan", "--disk-write-gbps",
                                                               args.disk_write_gbps, "GB/s")
    read = None if args.disk_read_gbps is None else positive("plan", "--disk-read-gbps",
                                                             args.disk_read_gbps, "GB/s")
    if args.host_budget_mb is None:
        if write is not None or read is not None:
            raise SystemExit("hyperpar plan: --disk-write-gbps and --disk-read-gbps need --host-budget-mb")
        return None
    budget = int(positive("plan", "--host-budget-mb", args.host_budget_mb, "MiB") * MIB)
    return budget, write or DEFAULT_WRITE_GBPS, read or DEFAULT_READ_GBPS


def print_tiers(est: HostTierEstimate, device_peak: int, device_budget: int) -> None:
    """The plan's three tiers: what each holds at its peak against its budget, and the disk's I/O."""
    widths = [7, 9, 11, 12, 14]
    print(_row(["tier", "peak MiB", "budget MiB", "to disk MiB", "from disk MiB"], widths))
    print(_row(["device", f"{device_peak / MIB:.1f}", f"{device_budget / MIB:.1f}", "-", "-"], widths))
    print(_row(["host", f"{est.peak_host_bytes_budgeted / MIB:.1f}", f"{est.host_budget_bytes / MIB:.1f}",
                "-", "-"], widths))
    print(_row(["disk", f"{est.peak_disk_bytes / MIB:.1f}", "-", f"{est.bytes_to_disk / MIB:.1f}",
                f"{est.bytes_from_disk / MIB:.1f}"], widths))
    verdict = "hides under compute (at best)" if est.fits else "longer than compute: the step waits for disk"
    print(f"  I/O on disk {est.write_ms:.2f} ms writing at {est.write_gbps:g} GB/s + {est.read_ms:.2f} ms "
          f"reading at {est.read_gbps:g} GB/s = {est.io_ms:.2f} ms against {est.compute_ms:.2f} ms of "
          f"compute: {verdict}; {est.demand_reads} read(s) on demand; without a host budget the host "
          f"would hold {est.peak_host_bytes / MIB:.1f} MiB")
    if est.step_with_disk_ms is not None and est.disk_wait_ms is not None:
        print(f"  timed on the plan's op times: the step waits {est.disk_wait_ms:.2f} ms for the disk "
              f"({est.disk_wait_room_ms:.2f} for room in slabs still being written, "
              f"{est.disk_wait_read_ahead_ms:.2f} for reads ahead, {est.disk_wait_on_demand_ms:.2f} for "
              f"reads on demand): {est.step_with_disk_ms:.2f} ms against the plan's {est.step_ms:.2f} ms")
    if est.kept_on_device_bytes:
        print(f"  {est.kept_on_device_bytes / MIB:.1f} MiB of copies found no host room: they stay on the "
              f"device, over its budget")


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))


def run(args: argparse.Namespace) -> int:
    from hyperpar.offload.ir import ActivationTrace, IRFormatError
    from hyperpar.offload.planning import simulate, verify
    from hyperpar.offload.planning.arrays import trace_arrays
    from hyperpar.offload.planning.bounds import min_feasible_budget_timed
    from hyperpar.offload.planning.deficit_warnings import deficit_warnings_muted
    from hyperpar.offload.planning.emit import emit_schedule
    from hyperpar.offload.planning.floor import budget_floor
    from hyperpar.offload.planning.host_tier import host_tier
    from hyperpar.offload.planning.sweep import plan_point, sweep, with_budget
    from hyperpar.offload.planning.tails import tails_taken

    plan_projection.check(args)
    tiers = _tier_flags(args)
    path = Path(args.trace)
    if not path.is_file():
        print(f"hyperpar plan: trace file {str(path)!r} does not exist", file=sys.stderr)
        return 2
    try:
        trace = ActivationTrace.load(path)
    except (IRFormatError, UnicodeDecodeError) as exc:
        print(f"hyperpar plan: {str(path)!r} is not a hyperpar trace: {exc}", file=sys.stderr)
        return 2
    if args.json:  # one JSON object on stdout, nothing else
        doc = plan_projection.levers(args, trace).as_dict()
        if tiers is not None:  # the offload-only plan at the JSON's budget
            # the plan on the device's model, timed there: its compute_ms, step_ms and disk
            # waits are the projected step's
            planned, schedule, sim = plan_projection.device_plan(args, trace, doc["budget_bytes"])
            tier = host_tier(planned, schedule, *tiers, timeline=sim).as_dict()
            tier["projected_step_ms"] = doc["offload_only_ms"]
            tier["fits_projected"] = tier["io_ms"] <= doc["offload_only_ms"]
            doc["host_tier"] = tier
        print(json.dumps(doc, indent=1))
        return 0
    trace = with_budget(trace, _budget_bytes(args.budget_mb, trace.memory_limit_bytes))
    baseline = simulate(trace, emit_schedule(trace, [], "none"))
    with deficit_warnings_muted():  # the table below says it
        point, schedule, sim = plan_point(trace, args.planner)
    verify(trace, schedule)

    peak = baseline.peak_resident_bytes
    taken, _ = tails_taken(trace, trace_arrays(trace))  # a lower bound: some schedule takes them off
    floor, timed_floor = budget_floor(trace), min_feasible_budget_timed(taken)
    print(f"trace {path}: {trace.num_ops} ops, {len(trace.storage_sizes)} storages, "
          f"peak without offload {peak / MIB:.1f} MiB; D2H {trace.d2h_bandwidth_gbps:g} GB/s, "
          f"H2D {trace.h2d_bandwidth_gbps:g} GB/s; no budget below {floor.floor_bytes / MIB:.1f} MiB can be "
          f"met, nor below {timed_floor / MIB:.1f} MiB without compute waiting for copies")
    print(f"  {floor.describe()}")
    head = ["planner", "budget MiB", "peak MiB", "step ms", "overhead", "wait ms", "moved MiB", "plan s"]
    widths = [8, 11, 10, 10, 9, 9, 10, 7]
    budget = f"{trace.memory_limit_bytes / MIB:.1f}"
    print(_row(head, widths))
    print(_row(["none", budget, f"{peak / MIB:.1f}", f"{baseline.predicted_step_ms:.2f}", "0.0%", "0.00",
                "0.0", "-"], widths))
    moved = (point.bytes_d2h + point.bytes_h2d) / MIB
    print(_row([args.planner, budget, f"{point.predicted_peak_bytes / MIB:.1f}",
                f"{point.predicted_step_ms:.2f}", f"{100 * point.overhead:.1f}%",
                f"{point.exposed_wait_ms:.2f}", f"{moved:.1f}", f"{point.plan_seconds:.2f}"], widths))
    if schedule.deficit_bytes:
        print(f"over budget by {schedule.deficit_bytes / MIB:.2f} MiB at op {schedule.deficit_op}")
    if tiers is not None:
        print()
        print_tiers(host_tier(trace, schedule, *tiers, timeline=sim), point.predicted_peak_bytes,
                    trace.memory_limit_bytes)

    out = Path(args.out)
    try:
        from hyperpar.offload.planning import plots
    except ImportError:  # pragma: no cover - matplotlib is an optional extra
        plots = None
    points = []
    if args.sweep:
        from tqdm import tqdm

        fractions = [f / 10 for f in range(1, 11)]
        points = sweep(trace, ("greedy", "timed"), fractions,
                       progress=lambda jobs: tqdm(jobs, desc="sweep", unit="plan", file=sys.stderr))
        print()
        print(_row(["budget", "greedy ovh", "timed ovh", "greedy over", "timed over"], [7, 11, 10, 12, 11]))
        by_job = {(p.planner, p.budget_fraction): p for p in points}
        for f in fractions:
            g, t = by_job["greedy", f], by_job["timed", f]
            print(_row([f"{100 * f:.0f}%", f"{100 * g.overhead:.1f}%", f"{100 * t.overhead:.1f}%",
                        f"{g.deficit_bytes / MIB:.1f} MiB", f"{t.deficit_bytes / MIB:.1f} MiB"],
                       [7, 11, 10, 12, 11]))
    if args.device is not None:
        plan_projection.report(args, trace, out if plots is not None else None)
        if args.budget_fraction is not None:
            plan_projection.print_levers(plan_projection.levers(args, trace))
    if plots is None:
        print("matplotlib is not installed: no plots (pip install 'hyperpar[plot]')")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "resident.png", out / "lanes.png"]
    if args.device is not None:
        written.append(out / "projection.png")
    title = f"{args.planner} planner, budget {trace.memory_limit_bytes / MIB:.0f} MiB"
    plots.plot_resident(written[0], baseline.resident_bytes, sim, trace.memory_limit_bytes, title,
                        floor=floor.floor_bytes)
    plots.plot_lanes(written[1], sim, title)
    if points:
        written.append(out / "sweep.png")
        plots.plot_sweep(written[-1], points, f"memory vs overhead: {path.name}",
                         floor_fraction=floor.floor_bytes / peak if peak else None)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
