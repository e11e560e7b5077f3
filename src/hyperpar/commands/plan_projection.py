"""``hyperpar plan TRACE --device h100``: the projected GPU step of plain PyTorch and the session."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from hyperpar.commands.flags import non_negative
from hyperpar.offload.ir import ActivationTrace, ResidencySchedule

if TYPE_CHECKING:
    from hyperpar.offload.planning.simulate import SimResult
    from hyperpar.offload.projection import HostCosts
    from hyperpar.offload.projection.levers import LeverSteps

MIB = 1 << 20
HOST_FLAGS = (("--host-us-plain", "plain_us", "plain PyTorch"),
              ("--host-us-replay", "replay_us", "the session's replay"),
              ("--host-us-warmup", "warmup_us", "the session's warmup (trace)"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hyperpar.offload.projection import DEVICES, HostCosts

    defaults = HostCosts()
    parser.add_argument("--device", default=None, metavar="NAME",
                        help=f"also project the step on this GPU model ({', '.join(sorted(DEVICES))})")
    parser.add_argument("--budget-fraction", default=None, metavar="F",
                        help="with --device: the budget as a share in (0, 1] of the trace's movable "
                             "activation peak (plus the bytes it keeps), and each lever's projected step "
                             "at it")
    parser.add_argument("--json", action="store_true",
                        help="with --device and --budget-fraction: print one JSON object (plain_ms, step_ms, "
                             "full_ac_ms, offload_only_ms, peak_bytes, budget_bytes, offload_bytes, "
                             "recompute_bytes, ...) and nothing else")
    for flag, attr, what in HOST_FLAGS:
        parser.add_argument(flag, default=None, metavar="US",
                            help=f"host µs per op of {what} (default {getattr(defaults, attr):g}, "
                                 "CPU-measured; pass the GPU-measured one)")


def _host_costs(args: argparse.Namespace) -> HostCosts:
    from hyperpar.offload.projection import HostCosts

    values = {}
    for flag, attr, _ in HOST_FLAGS:
        text = getattr(args, flag[2:].replace("-", "_"))
        if text is None:
            continue
        value = non_negative("plan", flag, text, "µs")
        values[attr] = value
    return HostCosts(**values)


def _share(count: int, total: int) -> str:
    return f"{count} ({100 * count / max(total, 1):.0f}%)"


def check(args: argparse.Namespace) -> None:
    """Reject a bad --device or host cost before any planning work."""
    from hyperpar.offload.projection import DEVICES

    if args.device is not None and args.device.lower() not in DEVICES:
        raise SystemExit(f"hyperpar plan: --device must be one of {sorted(DEVICES)}, got {args.device!r}")
    _host_costs(args)
    if args.budget_fraction is not None:
        fraction = fraction_of(args)
        if args.device is None:
            raise SystemExit(f"hyperpar plan: --budget-fraction {fraction:g} needs --device")
    if args.json and (args.device is None or args.budget_fraction is None):
        raise SystemExit("hyperpar plan: --json needs --device and --budget-fraction")


def fraction_of(args: argparse.Namespace) -> float:
    try:
        value = float(args.budget_fraction)
    except ValueError:
        raise SystemExit(f"hyperpar plan: --budget-fraction must be a number in (0, 1], "
                         f"got {args.budget_fraction!r}") from None
    if not 0 < value <= 1:  # NaN fails too
        raise SystemExit(f"hyperpar plan: --budget-fraction must be in (0, 1], got {args.budget_fraction!r}")
    return value


def levers(args: argparse.Namespace, trace: ActivationTrace) -> LeverSteps:
    """Each lever's projected step at ``--budget-fraction`` (``projection.levers``)."""
    from hyperpar.offload.projection import get_device
    from hyperpar.offload.projection.levers import lever_steps

    return lever_steps(trace, get_device(args.device), _host_costs(args), fraction_of(args), args.planner)


def device_plan(args: argparse.Namespace, trace: ActivationTrace, budget_bytes: int
                ) -> tuple[ActivationTrace, ResidencySchedule, SimResult]:
    """The offload-only plan on ``--device``'s model at ``budget_bytes`` (its floor where that is
    higher, as the levers plan): the trace as the planner sees it there, its schedule and its
    simulation, the device's timeline (``projection.timeline.device_plan``)."""
    from hyperpar.offload.projection import get_device, op_costs
    from hyperpar.offload.projection.levers import floor_at
    from hyperpar.offload.projection.timeline import device_plan as plan_on
    from hyperpar.offload.projection.timeline import device_times_us

    device = get_device(args.device)
    budget = max(budget_bytes, floor_at(trace, budget_bytes))
    planned, _, schedule, sim = plan_on(trace, device_times_us(op_costs(trace), device), device,
                                        _host_costs(args), budget, args.planner)
    return planned, schedule, sim


def print_levers(r: LeverSteps) -> None:
    full = "-" if r.full_ac_ms is None else f"{r.full_ac_ms / r.plain_ms:.2f}x"
    print(f"levers at {r.budget_bytes / MIB:.1f} MiB ({r.peak_bytes / MIB:.1f} MiB movable peak + "
          f"{r.kept_bytes / MIB:.1f} MiB kept) on {r.device}: plain {r.plain_ms:.3f} ms, offload only "
          f"{r.offload_only_ms / r.plain_ms:.2f}x, full checkpointing {full}, "
          f"mixed {r.step_ms / r.plain_ms:.2f}x "
          f"({r.rebuilt_layers} of {r.layers} layers rebuilt: {r.recompute_bytes / MIB:.1f} MiB made again "
          f"in backward, {r.offload_bytes / MIB:.1f} MiB to host, the rest kept on the device"
          f"{'' if r.meets_budget else ', over budget: planned for its floor'}); floor "
          f"{r.floor_bytes / MIB:.1f} MiB, offload only {r.offload_only_floor_bytes / MIB:.1f} MiB")


def report(args: argparse.Namespace, trace: ActivationTrace, out: Path | None) -> Path | None:
    """Print the projection table; draw it into ``out`` (when given); return the plot's path."""
    from hyperpar.offload.projection import get_device, project

    proj = project(trace, get_device(args.device), _host_costs(args), trace.memory_limit_bytes, args.planner)
    h, d = proj.host, proj.device
    print()
    print(f"projection on {d.name}: {d.peak_tflops:g} TFLOP/s, HBM {d.hbm_gbps:g} GB/s, link "
          f"{d.link_gbps:g} GB/s each way, launch {d.launch_us:g} µs; host µs/op plain {h.plain_us:g}, "
          f"replay {h.replay_us:g}, warmup {h.warmup_us:g}")
    costs = proj.costs
    if not costs.has_shapes:
        print("  the trace has no shapes: FLOPs unknown, device time from storage bytes alone")
    elif costs.flops_unknown:
        print(f"  {costs.flops_unknown} matmul/attention ops without a derivable shape: costed by bytes")
    print(f"  {proj.num_ops} ops, {proj.kernels} kernels, {costs.total_flops / 1e12:.3f} TFLOP, "
          f"{costs.total_bytes / 1e9:.3f} GB through HBM; "
          f"device busy {proj.plain.device_busy_us / 1e3:.3f} ms")
    widths = [8, 10, 10, 9, 9, 14, 16]
    print("  ".join(c.rjust(w) for c, w in zip(
        ["path", "step ms", "host ms", "wait ms", "x plain", "launch-bound", "launch-bound k"], widths,
        strict=True)))
    for name, path in (("plain", proj.plain), ("warmup", proj.warmup), ("replay", proj.replay)):
        cells = [name, f"{path.step_us / 1e3:.3f}", f"{path.host_us / 1e3:.3f}",
                 f"{path.copy_wait_us / 1e3:.3f}",
                 f"{path.step_us / proj.plain.step_us:.2f}" if proj.plain.step_us else "-",
                 _share(path.launch_bound_ops, proj.num_ops), _share(path.launch_bound_kernels, proj.kernels)]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    print(f"  the replay at budget {proj.budget_bytes / MIB:.1f} MiB: peak {proj.peak_bytes / MIB:.1f} MiB, "
          f"D2H {proj.bytes_d2h / MIB:.1f} MiB, H2D {proj.bytes_h2d / MIB:.1f} MiB"
          + (f", over budget by {proj.deficit_bytes / MIB:.1f} MiB" if proj.deficit_bytes else ""))
    print("  (warmup: its host cost only, without its copies; launch-bound k: among kernels)")
    if out is None:
        return None
    from hyperpar.offload.projection.plot import plot_projection

    out.mkdir(parents=True, exist_ok=True)
    path = out / "projection.png"
    plot_projection(path, proj, f"{d.name}: device time vs host cost per op")
    return path
