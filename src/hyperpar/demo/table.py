"""The demo's final tables as plain text (no extra dependency)."""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Sequence

from hyperpar.demo.results import DemoResult, RunResult

MIB = 1 << 20
REPEAT = "repeat"  # the second plain run: a check, not a run of its own in the loss and memory tables


def _grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt.format(*header), rule, *(fmt.format(*r) for r in rows)])


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.2f} MiB"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _same(a: RunResult | None, b: RunResult | None, i: int) -> str | None:
    if a is None or b is None:
        return None
    both = i < len(a.losses) and i < len(b.losses)
    return "bitwise" if both and a.losses[i].hex() == b.losses[i].hex() else "DIFFERENT"


def loss_table(result: DemoResult) -> str:
    """Loss per step of each run, then two bitwise checks: the plain run against its repeat
    (does plain PyTorch reproduce itself here?) and against offload."""
    base, again, off = result.run("baseline"), result.run(REPEAT), result.run("offload")
    shown = [r for r in result.runs if r.name != REPEAT]
    checks = [(title, a, b) for title, a, b in (("baseline == repeat", base, again),
                                                 ("baseline == offload", base, off))
              if a is not None and b is not None]
    header = ["step", *(r.name for r in shown), *(title for title, _, _ in checks)]
    rows = []
    for i in range(max(len(r.losses) for r in result.runs)):
        row = [str(i), *(f"{r.losses[i]:.6f}" if i < len(r.losses) else "-" for r in shown)]
        rows.append(row + [str(_same(a, b, i)) for _, a, b in checks])
    return _grid(header, rows)


def memory_table(runs: Sequence[RunResult]) -> str:
    header = ["run", "peak activations", "budget", "feasible floor", "fast-path floor", "moved/step",
              "faults"]
    rows = [
        [r.name, _mib(r.peak_activation_bytes), _mib(r.budget_bytes), _mib(r.min_feasible_budget_bytes),
         _mib(r.fast_path_floor_bytes),
         _mib(r.bytes_moved_per_step), "-" if r.demand_faults is None else str(r.demand_faults)]
        for r in runs if r.name != REPEAT
    ]
    return _grid(header, rows)


def cpu_ratio(run: RunResult, base: RunResult | None) -> float | None:
    """Median over the steps after the first of this run's CPU time / the baseline's, step by
    step: the runs took turns, so a busy machine weighs on both sides of each ratio alike."""
    if base is None or not run.step_cpu_ms or len(run.step_cpu_ms) != len(base.step_cpu_ms):
        return None
    pairs = list(zip(run.step_cpu_ms, base.step_cpu_ms, strict=True))
    ratios = [a / b for a, b in (pairs[1:] or pairs) if b > 0]
    return statistics.median(ratios) if ratios else None


def time_table(runs: Sequence[RunResult]) -> str:
    base = next((r for r in runs if r.name == "baseline"), None)
    header = ["run", "step wall (median)", "step CPU (median)", "CPU x baseline", "exposed wait",
              "predicted step"]
    rows = []
    for r in runs:
        ratio = cpu_ratio(r, base) if r.name in ("baseline", REPEAT, "offload") else None
        rows.append([r.name, _ms(r.steady_step_ms), _ms(r.steady_step_cpu_ms), "-" if ratio is None
                     else f"{ratio:.2f}", _ms(r.exposed_wait_ms), _ms(r.predicted_step_ms)])
    return _grid(header, rows)


def timing_note(result: DemoResult) -> str:
    load = result.load_average
    busy = ""
    if load:
        cpus = result.settings.get("cpus") or 1
        busy = (f"load average {load[0]:.1f} at the start, {load[-1]:.1f} at the end, on {cpus} CPUs"
                + ("; the machine was busy, so wall times are noisy" if max(load) > 0.75 * cpus else ""))
    return textwrap.fill(
        "Plain, repeat and offload took turns step by step; CPU is the process's CPU time for the step "
        "(every thread: compute and copy threads), steadier than wall time on a shared machine"
        + (f" ({busy})." if busy else "."), 100)


def render(result: DemoResult) -> str:
    parts = ["Loss per step", loss_table(result), "", "Memory", memory_table(result.runs), "",
             "Time (median over the steps after the first)", time_table(result.runs), timing_note(result)]
    notes = [f"- {r.name}: {n}" for r in result.runs for n in r.notes]
    if notes:
        parts += ["", "Notes", *notes]
    return "\n".join(parts)
