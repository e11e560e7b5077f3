"""Warmup: run the step once on the online path, recording what every op touched.

The budget is kept online (see ``executor_base``); when nothing is left to evict the
overshoot is recorded, never raised.
"""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.offload.capture.executor_base import ExecutorBase, OpState, internal, op_name
from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.runtime import ResidencyManager

__all__ = ["WarmupExecutor", "op_name"]


class WarmupExecutor(ExecutorBase):
    phase = "warmup"

    def __init__(self, manager: ResidencyManager, device: torch.device, budget_bytes: int) -> None:
        super().__init__(manager, device, budget_bytes)
        self.recording = True

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.online_op(func, args, kwargs)

    def begin_opaque(self, name: str, reads: list[torch.UntypedStorage]) -> OpState:
        return self.online_begin_opaque(name, reads)

    def end_opaque(self, token: OpState, outputs: list[torch.Tensor]) -> None:
        self.online_end_opaque(token, outputs)

    def finish(self, clean: bool, step_ms: float) -> tuple[StepReport, Exception | None]:
        self.closed = True
        self.release_region_graphs()
        with internal(self):
            self.manager.restore_all()
        return self.report(step_ms), None

    def report(self, step_ms: float, **extra: Any) -> StepReport:
        m = self.manager
        return StepReport(
            phase=self.phase, op_count=self.index, peak_resident_bytes=self.peak_bytes,
            budget_bytes=self.budget_bytes, bytes_d2h=m.bytes_d2h, bytes_h2d=m.bytes_h2d,
            demand_faults=m.demand_faults, step_ms=step_ms,
            overshoot_bytes=max(self.peak_bytes - self.budget_bytes, 0),
            overshoot_op=self.peak_op if self.peak_bytes > self.budget_bytes else None,
            offload_cap_hits=m.cap_hits, **extra,
        )

    def build_trace(self, d2h_gbps: float, h2d_gbps: float) -> ActivationTrace:
        """Call after finish(): storages still alive are retained."""
        return recorded_trace(self, d2h_gbps, h2d_gbps, first_timed=0)


def recorded_trace(ex: ExecutorBase, d2h_gbps: float, h2d_gbps: float, first_timed: int) -> ActivationTrace:
    """The trace an executor recorded on its online path; ops before ``first_timed`` keep the
    durations they came with (a diverged replay's prefix, taken from its plan)."""
    table = ex.table
    timer = ex.timer
    if timer is not None and ex.op_marks:
        times = timer.times_ms()
        timed = ex.ops[first_timed:]
        gaps = ex._gaps_ms if not timer.use_events else [0.0] * len(timed)
        for op, (_, begin, end), gap in zip(timed, ex.op_marks[-len(timed):], gaps[-len(timed):],
                                            strict=True):
            op.duration_ms = max(times[end] - times[begin], 0.0) + gap
    sizes: dict[int, int] = {}
    for op in ex.ops:
        for acc in op.accesses:
            sizes[acc.storage_id] = max(sizes.get(acc.storage_id, 0), table.nbytes[acc.storage_id])
    retained = frozenset(sid for sid in table.alive() if sid in sizes)
    last: dict[int, int] = {}
    for i, op in enumerate(ex.ops):
        for acc in op.accesses:
            last[acc.storage_id] = i
    # When Python let go of a storage, for the ones no copy held on to.
    deaths = {sid: op for sid, op in table.death.items()
              if sid in last and op > last[sid] and sid not in ex.moved_sids}
    return ActivationTrace(
        ops=ex.ops, storage_sizes=sizes, retained_sids=retained,
        memory_limit_bytes=ex.budget_bytes, d2h_bandwidth_gbps=d2h_gbps,
        h2d_bandwidth_gbps=h2d_gbps, guides=ex.guides,
        pinned_sids=frozenset(s for s in table.pinned if s in sizes),
        death_ops=deaths,
    )
