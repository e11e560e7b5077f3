"""What each demo run measured, in a form the table, the plot and ``demo.json`` share."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


def steady(values: list[float]) -> float | None:
    """Median after the first entry (the first step traces, warms caches, binds)."""
    later = values[1:] or values
    return statistics.median(later) if later else None


@dataclass
class RunResult:
    name: str
    losses: list[float]
    step_ms: list[float]  # wall clock per step
    step_cpu_ms: list[float] = field(default_factory=list)  # this process's CPU time per step, all threads
    peak_activation_bytes: int | None = None  # measured by the residency manager, when known
    budget_bytes: int | None = None
    bytes_moved_per_step: int | None = None  # d2h + h2d of the last step
    demand_faults: int | None = None
    predicted_step_ms: float | None = None
    exposed_wait_ms: float | None = None
    min_feasible_budget_bytes: int | None = None  # the least budget any schedule can meet
    fast_path_floor_bytes: int | None = None  # the least budget the fast path can run at
    reports: list[dict[str, Any]] = field(default_factory=list)  # StepReport.as_dict() per step
    notes: list[str] = field(default_factory=list)

    @property
    def steady_step_ms(self) -> float | None:
        """Median step time after the first step (the first one traces, warms caches, binds)."""
        return steady(self.step_ms)

    @property
    def steady_step_cpu_ms(self) -> float | None:
        return steady(self.step_cpu_ms)

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["steady_step_ms"] = self.steady_step_ms
        doc["steady_step_cpu_ms"] = self.steady_step_cpu_ms
        doc["losses_hex"] = [x.hex() for x in self.losses]  # the exact bits, for bitwise checks
        return doc


@dataclass
class DemoResult:
    settings: dict[str, Any]
    runs: list[RunResult]
    losses_equal: bool  # baseline vs offload, bitwise
    weights_equal: bool  # final parameters, baseline vs offload, bitwise
    plain_repeats: bool = True  # baseline vs a second plain run (losses and weights), bitwise
    plain_differences: list[str] = field(default_factory=list)  # what differs, baseline vs repeat
    resident_bytes_plain: list[int] = field(default_factory=list)  # per op, from the trace
    resident_bytes_planned: list[int] = field(default_factory=list)  # per op, simulated schedule
    files: dict[str, str] = field(default_factory=dict)
    total_s: float = 0.0
    differences: list[str] = field(default_factory=list)  # what differs, baseline vs offload
    load_average: list[float] = field(default_factory=list)  # 1-minute load at the start and the end

    def run(self, name: str) -> RunResult | None:
        return next((r for r in self.runs if r.name == name), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "runs": {r.name: r.as_dict() for r in self.runs},
            "losses_equal": self.losses_equal,
            "weights_equal": self.weights_equal,
            "plain_repeats": self.plain_repeats,
            "plain_differences": self.plain_differences,
            "resident_bytes_plain": self.resident_bytes_plain,
            "resident_bytes_planned": self.resident_bytes_planned,
            "files": self.files,
            "total_s": self.total_s,
            "differences": self.differences,
            "load_average": self.load_average,
        }
