"""``hyperpar plan TRACE.json``: plan a saved trace, print the figures and draw the plots
(with ``--device``, also the projected GPU step: ``plan_projection``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hyperpar.commands import plan_projection
from hyperpar.commands.flags import non_negative

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
    plan_projection.add_arguments(parser)


def _budget_bytes(text: str | None, default: int) -> int:
    return default if text is None else int(non_negative("plan", "--budget-mb", text, "MiB") * MIB)


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
    from hyperpar.offload.planning.sweep import plan_point, sweep, with_budget
    from hyperpar.offload.planning.tails import tails_taken

    plan_projection.check(args)
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
        print(json.dumps(plan_projection.levers(args, trace).as_dict(), indent=1))
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
