"""The demo's final table as plain text (no extra dependency)."""

from __future__ import annotations

from collections.abc import Sequence

from hyperpar.demo.results import DemoResult, RunResult

MIB = 1 << 20


def _grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt.format(*header), rule, *(fmt.format(*r) for r in rows)])


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.2f} MiB"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def loss_table(result: DemoResult) -> str:
    """Loss per step for each run; the ``equal`` column compares baseline and offload bitwise."""
    base, off = result.run("baseline"), result.run("offload")
    steps = max(len(r.losses) for r in result.runs)
    header = ["step", *(r.name for r in result.runs)]
    if base is not None and off is not None:
        header.append("baseline == offload")
    rows = []
    for i in range(steps):
        row = [str(i), *(f"{r.losses[i]:.6f}" if i < len(r.losses) else "-" for r in result.runs)]
        if base is not None and off is not None:
            both = i < len(base.losses) and i < len(off.losses)
            same = both and base.losses[i].hex() == off.losses[i].hex()
            row.append("bitwise" if same else "DIFFERENT")
        rows.append(row)
    return _grid(header, rows)


def summary_table(runs: Sequence[RunResult]) -> str:
    header = ["run", "peak activations", "budget", "moved/step", "faults", "exposed wait", "step (median)",
              "predicted step"]
    rows = [
        [r.name, _mib(r.peak_activation_bytes), _mib(r.budget_bytes), _mib(r.bytes_moved_per_step),
         "-" if r.demand_faults is None else str(r.demand_faults), _ms(r.exposed_wait_ms),
         _ms(r.steady_step_ms), _ms(r.predicted_step_ms)]
        for r in runs
    ]
    return _grid(header, rows)


def render(result: DemoResult) -> str:
    parts = ["Loss per step", loss_table(result), "", "Memory and time", summary_table(result.runs)]
    notes = [f"- {r.name}: {n}" for r in result.runs for n in r.notes]
    if notes:
        parts += ["", "Notes", *notes]
    return "\n".join(parts)
