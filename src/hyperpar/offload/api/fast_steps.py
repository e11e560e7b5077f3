"""The session's side of the fast path (``capture.fast_replay``): when a step may take it,
what a departure switches to, and what the session learns from a fast or checked step."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from hyperpar.offload.api.plans import FastStep, Plan
from hyperpar.offload.capture import ExecutorBase, OffloadDispatchMode, ReplayExecutor, host_reads
from hyperpar.offload.capture.fast_replay import FallbackExecutor
from hyperpar.offload.capture.saved_tensor_guard import SavedTensorGuard
from hyperpar.offload.ir.report import StepReport

logger = logging.getLogger("hyperpar.offload.api.session")

FAST_DEPARTURES = 2  # fast steps of a structure that departed, after which it stays checked


class FastSteps:
    """Mixed into ``OffloadSession`` (its attributes are the session's)."""

    _structures: Any
    _budget_bytes: int
    _manager: Any
    _executor: Any
    _mode: Any
    _running: Plan | None
    _current: Plan | None
    device: Any
    config: Any
    phase: str
    last_report: StepReport | None

    def _fast_ok(self, plan: Plan) -> bool:
        """Whether the step may take the fast path: a plan that moves nothing within the
        budget, with the saved tensors of a clean checked replay to compare against."""
        return (self.config.fast_replay and bool(plan.packs) and not plan.moves
                and not plan.program.region_accesses
                and plan.program.planned_peak <= self._budget_bytes
                and self._structures[plan.signature].departures < FAST_DEPARTURES)

    def _fall_back(self, index: int, why: str) -> None:
        """A fast step's saved tensor ``index`` differs from its plan's (called from the pack
        hook): the rest of the step runs on the online path, within the budget."""
        fast = self._fast
        assert fast is not None
        if threading.get_ident() != fast.thread or torch._C._current_graph_task_id() != -1:
            # in backward, or on another thread (a forked TorchScript task): the dispatch mode
            # cannot take over there; nothing was moved, so the step finishes as it runs
            logger.warning("fast replay departed from its plan at saved tensor %d (%s) inside backward: "
                           "the step finishes unchecked, and its plan is checked again next step",
                           index, why)
            return
        logger.info("fast replay departed from its plan at saved tensor %d (%s): the rest of the step "
                    "keeps the budget online", index, why)
        m = self._manager
        executor = FallbackExecutor(m, self.device, self._budget_bytes, index, why, fast.guard.storages)
        m.describe_op = executor.describe_op
        self._executor = executor
        self._mode = OffloadDispatchMode(executor, self)
        host_reads.step_started(executor)
        m.engine.begin_step()
        self._mode.__enter__()

    def _exit_fast(self, fast: FastStep, clean: bool) -> None:
        """A fast step that needed no fallback: its report, and what the session learns."""
        if not clean:
            return
        plan = fast.plan
        structure = self._structures[plan.signature]
        report = StepReport(phase="replay", op_count=plan.program.num_ops,
                            peak_resident_bytes=plan.program.planned_peak, budget_bytes=self._budget_bytes,
                            step_ms=(time.perf_counter() - fast.t0) * 1e3,
                            predicted_step_ms=plan.predicted_ms, replay_path="fast")
        if not fast.guard.complete():  # it ended early, or departed in backward: peak the plan's, unmeasured
            report.departed_at_saved = (fast.guard.count if fast.guard.departed_at is None
                                        else fast.guard.departed_at)
            plan.packs = None
            structure.departures += 1
        plan.floor.annotate(report)
        self._structures.move_to_end(plan.signature)
        structure.last = plan
        self._learn(plan.signature)
        self._current = plan
        self.phase = "replay"
        self.last_report = report

    def _after_fallback(self, executor: FallbackExecutor, report: StepReport) -> None:
        """A fast step that departed: its plan is checked again next time (or traced there)."""
        plan = self._running
        assert plan is not None
        plan.packs = None
        self._structures[plan.signature].departures += 1
        self.phase = "warmup" if self._choose() is None else "replay"
        self.last_report = report

    def _learn_packs(self, executor: ExecutorBase, recorder: SavedTensorGuard) -> None:
        """A checked replay that followed its plan to the end: its saved tensors are what a
        fast step of that plan must save."""
        plan = self._running
        if (isinstance(executor, ReplayExecutor) and plan is not None and executor.diverged_at is None
                and executor.program is plan.program and not plan.moves and recorder.count
                and not recorder.lifted):
            plan.packs = tuple(recorder.fingerprints)
