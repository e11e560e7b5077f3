"""PNG plots of plans (matplotlib is an optional extra: ``pip install hyperpar[plot]``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from hyperpar.offload.planning.simulate import SimResult
from hyperpar.offload.planning.sweep import PlanPoint

GIB = float(1 << 30)
MIB = float(1 << 20)


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_resident(path: Path, without: Sequence[int], planned: SimResult, budget: int, title: str,
                  floor: int | None = None) -> None:
    """``floor``: the feasible floor (``budget_floor``), drawn when given: no plan goes under it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    ops = range(len(without))
    scale, unit = (GIB, "GiB") if max([*without, budget], default=0) >= GIB else (MIB, "MiB")
    ax.plot(ops, [b / scale for b in without], label="no offload", color="0.6", lw=1)
    ax.plot(ops, [b / scale for b in planned.resident_bytes], label="planned (simulated)", color="C0", lw=1)
    ax.axhline(budget / scale, color="C3", ls="--", lw=1, label="budget")
    if floor is not None:
        ax.axhline(floor / scale, color="0.3", ls=":", lw=1, label="feasible floor")
    ax.set_xlabel("op")
    ax.set_ylabel(f"resident activations ({unit})")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lanes(path: Path, sim: SimResult, title: str) -> None:
    """Compute, D2H and H2D lanes over time; red ticks mark exposed waits."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 2.8))
    lanes = (
        ("H2D", [(s, e - s) for s, e, _ in sim.h2d_lane], "C2"),
        ("D2H", [(s, e - s) for s, e, _ in sim.d2h_lane], "C1"),
        ("compute", [(s, e - s) for s, e in zip(sim.op_start_ms, sim.op_end_ms, strict=True)], "C0"),
    )
    for y, (_, spans, color) in enumerate(lanes):
        ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color, edgecolor="none")
    waits = [(s - w, w) for s, w in zip(sim.op_start_ms, sim.op_wait_ms, strict=True) if w > 0]
    if waits:
        ax.broken_barh(waits, (1.6, 0.8), facecolors="C3", edgecolor="none")
    ax.set_yticks(range(3), [name for name, _, _ in lanes])
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{title}: exposed wait {sim.exposed_wait_ms:.2f} ms (red)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(path: Path, points: Sequence[PlanPoint], title: str,
               floor_fraction: float | None = None) -> None:
    """``floor_fraction``: the feasible floor over the peak, drawn when given."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, planner in enumerate(sorted({p.planner for p in points})):
        mine = sorted((p for p in points if p.planner == planner), key=lambda p: p.budget_fraction)
        ax.plot([100 * p.budget_fraction for p in mine], [100 * p.overhead for p in mine],
                marker="o", color=f"C{i}", label=planner)
        over = [p for p in mine if p.deficit_bytes > 0]
        if over:
            ax.scatter([100 * p.budget_fraction for p in over], [100 * p.overhead for p in over],
                       marker="x", color="C3", zorder=3, label=f"{planner}: over budget")
    if floor_fraction is not None:
        ax.axvline(100 * floor_fraction, color="0.3", ls=":", lw=1, label="feasible floor")
    ax.set_xlabel("budget (% of the peak without offload)")
    ax.set_ylabel("predicted step-time overhead (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
