"""The session's side of recompute: whether rebuilding could pay (on the first trace), the
module calls of the step that follows, the choice made on them (``planning.levers``), and the
chosen calls checkpointed on every later step.

The module calls are recorded on the checked replay after warmup, not in warmup: global
module hooks change what ``torch.compile`` traces, and most steps never need them (a plan
whose copies hide behind compute, a budget that holds the whole peak). The choice is made
once: a step that rebuilds is another step (its backward runs the rebuilt calls' ops, its
forward keeps less), so the next step is traced again and the plan that offloads the rest
is made on that trace, as the step really runs. Steps with compiled or ``skip_offload``
regions are not rebuilt (their calls are not seen).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from typing import Any

import numpy as np

from hyperpar.offload.capture import ExecutorBase, ReplayExecutor
from hyperpar.offload.capture.tracing.module_spans import ModuleSpans
from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.planning.arrays import TraceArrays, arrays_given, resident_without_offload, trace_arrays
from hyperpar.offload.planning.deficit_warnings import deficit_warnings_muted
from hyperpar.offload.planning.floor import budget_floor
from hyperpar.offload.planning.levers import (
    RecomputeChoice,
    choose_recompute,
    hideable_bytes,
    regions_of,
    worth_looking,
)
from hyperpar.offload.planning.levers.rebuilt_trace import rebuilt_trace
from hyperpar.offload.runtime.recompute_regions import RecomputeMismatchError, RecomputeRegions

logger = logging.getLogger("hyperpar.offload.api.session")
OVER_TOLERANCE = 0.01  # of the budget: choices this close to the least over it count as keeping it
SAVES_IN_BACKWARD = ("the step saves tensors inside its backward (create_graph=True, or the model's own "
                     "checkpointing): a call rebuilt there would sum its second-order gradients in "
                     "another order than plain PyTorch, not bitwise")


class RecomputeSteps:
    """Mixed into ``OffloadSession`` (its attributes are the session's)."""

    config: Any
    _budget_bytes: int
    _next: dict[int, int | None]
    _recompute: RecomputeRegions | None
    _recompute_choice: RecomputeChoice | None
    _module_spans: ModuleSpans | None
    _recompute_stack: contextlib.ExitStack | None
    _recompute_applied: bool  # the running (or last) step ran with the chosen calls checkpointed
    _want_spans: bool  # the next checked replay records module calls for the choice
    _recompute_trusted: bool  # a step compared every rebuilt output with forward's: later ones need not
    _offload_only_floor: int | None  # the floor of the step the choice was made on (nothing rebuilt)
    _saved_in_backward: bool  # the last clean step saved tensors inside its backward
    _recompute_stop: bool  # rebuild nothing from the next step on

    def _recompute_init(self) -> None:
        self._recompute = None  # module calls rebuilt in backward, chosen once
        self._recompute_choice = None
        self._module_spans = None
        self._recompute_stack = None
        self._recompute_applied = False
        self._want_spans = False
        self._recompute_trusted = False
        self._offload_only_floor = None
        self._saved_in_backward = False
        self._recompute_stop = False  # a step's backward built a graph through rebuilt calls

    def _recompute_enter(self, executor: ExecutorBase | None) -> None:
        """At a step's start: the chosen calls checkpointed; on the checked replay the choice
        waits for, its module calls recorded."""
        if self._recompute_stop:
            self._recompute, self._recompute_stop = None, False
        stack = contextlib.ExitStack()
        self._recompute_applied = self._recompute is not None
        try:
            if self._recompute is not None:
                stack.enter_context(self._recompute.applied(
                    check=self.config.verify or not self._recompute_trusted))
            if self._want_spans and isinstance(executor, ReplayExecutor):
                self._module_spans = stack.enter_context(ModuleSpans(lambda: executor.index))
        except BaseException:
            stack.close()
            raise
        self._recompute_stack = stack

    def _recompute_exit(self, check: bool) -> RecomputeMismatchError | None:
        """At a step's end: the modules' own ``forward`` back; with ``check`` (a step that ended
        without error), the error for a rebuilt output that differed from forward's, if any."""
        stack, self._recompute_stack = self._recompute_stack, None
        if stack is not None:
            stack.close()
        if self._recompute is None or not self._recompute_applied:
            return None
        compared = len(self._recompute.checks)
        mismatch = self._recompute.mismatch()
        if self._recompute.graph_built:  # this step's rebuilt calls: equal to rounding, not bitwise
            logger.warning("recompute: a backward built a graph through rebuilt calls (create_graph=True): "
                           "its gradients equal plain PyTorch's to rounding, not bitwise; nothing is "
                           "rebuilt from the next step on")
            self._recompute_choice = RecomputeChoice(why=SAVES_IN_BACKWARD)  # (this step still reports
            self._recompute_stop = True  # what it rebuilt; the next one rebuilds nothing)
            return mismatch if check else None
        if not check:
            return None
        self._recompute_trusted = self._recompute_trusted or (compared > 0 and mismatch is None)
        return mismatch

    def _recompute_report(self, report: StepReport) -> None:
        """The step's report: what its checkpointed calls did not keep (none before the choice)."""
        if self._recompute is not None and self._recompute_applied:
            report.bytes_recomputed = self._recompute.step_bytes
            report.offload_only_floor_bytes = self._offload_only_floor

    def _recompute_costs(self, trace: ActivationTrace, arrays: TraceArrays, predicted_ms: float
                         ) -> tuple[TraceArrays, float, float, float, float, int]:
        """Op times, compute, the offload-only plan's exposed copies, the link each way and
        the bytes the budget makes a plan take off at the peak: measured here, or on the
        model of ``plan_for``."""
        d2h, h2d = trace.d2h_bandwidth_gbps, trace.h2d_bandwidth_gbps
        compute_ms = float(arrays.duration_ms.sum())
        exposed_ms = predicted_ms - compute_ms
        if self.config.plan_for is not None:
            arrays, compute_ms, exposed_ms, d2h = _on_device(trace, arrays, self.config.plan_for,
                                                             self._budget_bytes)
            h2d = d2h
        resident = resident_without_offload(arrays)
        need = (int(resident.max()) if len(resident) else 0) - self._budget_bytes
        return arrays, compute_ms, exposed_ms, d2h, h2d, need

    def _recompute_gate(self, trace: ActivationTrace, arrays: TraceArrays, predicted_ms: float,
                        regions: bool) -> None:
        """After the first warmup's plan: whether rebuilding could pay at all; if so the next
        checked replay records the module calls to choose from (``regions``: the step has
        compiled or opaque regions, whose calls are not seen: no rebuilding)."""
        if self._recompute_choice is not None or self._want_spans or self.config.recompute == "off":
            return
        if regions:
            self._recompute_choice = RecomputeChoice(why="the step has compiled or skip_offload regions")
            logger.info("recompute: none (%s)", self._recompute_choice.why)
            return
        if self.config.recompute == "layers":
            self._want_spans = True
            return
        _, compute_ms, exposed_ms, _, _, need = self._recompute_costs(trace, arrays, predicted_ms)
        why = worth_looking(need, exposed_ms, compute_ms)
        if why:
            self._recompute_choice = RecomputeChoice(why=why)
            logger.info("recompute: none (%s)", why)
        else:
            self._want_spans = True

    def _choose_recompute(self, signature: int, trace: ActivationTrace, arrays: TraceArrays,
                          predicted_ms: float) -> None:
        """After the checked replay that recorded the module calls: which to rebuild from now
        on (see ``planning.levers``); if any, the next step is traced again with them."""
        spans, self._module_spans = self._module_spans, None
        self._want_spans = False
        if spans is None or self._recompute_choice is not None:
            return
        if self._saved_in_backward:
            self._recompute_choice = RecomputeChoice(why=SAVES_IN_BACKWARD)
            logger.info("recompute: none (%s)", SAVES_IN_BACKWARD)
            return
        modules = {}
        calls = []
        for span in spans.spans:
            module = span.module()
            if module is not None:
                modules[id(module)] = module
                calls.append((id(module), span.first, span.end, span.depth))
        costs = self._recompute_costs(trace, arrays, predicted_ms)
        device_arrays, compute_ms, exposed_ms, d2h, h2d, need = costs
        regions = regions_of(device_arrays, calls, d2h, h2d)
        forward_end = max((end for _, _, end, _ in calls), default=0)
        if self.config.recompute == "layers":
            choice = choose_recompute(regions, need, exposed_ms, compute_ms, self._budget_bytes,
                                      everything=True)
        else:  # the cheapest-per-byte choices, full checkpointing and none, judged by the step each makes
            hidden = hideable_bytes(device_arrays, calls, d2h, h2d)
            choice = self._judged(trace, forward_end, [
                choose_recompute(regions, need, exposed_ms, compute_ms, self._budget_bytes,
                                 hidden_bytes=hidden),
                choose_recompute(regions, need, exposed_ms, compute_ms, self._budget_bytes),
                choose_recompute(regions, need, exposed_ms, compute_ms, self._budget_bytes, everything=True),
                RecomputeChoice(why="offload alone")])
        choice.forward_end = forward_end
        self._recompute_choice = choice
        if not choice.regions:
            logger.info("recompute: none (%s)", choice.why)
            return
        with arrays_given(trace, arrays):
            self._offload_only_floor = budget_floor(trace).floor_bytes
        self._recompute = RecomputeRegions([modules[r.key] for r in choice.regions],
                                           [r.freed_bytes // len(r.spans) for r in choice.regions])
        self._next[signature] = None  # the step with the rebuilt calls is another step: trace it
        logger.info("recompute: %s (%s)", ", ".join(sorted(set(self._recompute.names))), choice.why)

    def _judged(self, trace: ActivationTrace, forward_end: int, choices: list[RecomputeChoice]
                ) -> RecomputeChoice:
        """Of ``choices``, the one whose step (the trace it would record, ``rebuilt_trace``)
        is predicted fastest at the budget: projected on ``plan_for``'s model
        (``projection.project``, as ``hyperpar plan --device`` does), else planned and
        simulated on the times measured here. One that keeps the budget (or comes within
        ``OVER_TOLERANCE`` of the least over it) beats any other. Each is planned, not run."""
        scored = []
        seen: set[tuple[int, ...]] = set()
        for choice in choices:
            key = tuple(sorted(r.key for r in choice.regions))
            if key in seen:
                continue
            seen.add(key)
            rebuilt = rebuilt_trace(trace, [sp for r in choice.regions for sp in r.spans], forward_end)
            step_ms, over = self._predicted(replace(rebuilt, memory_limit_bytes=self._budget_bytes))
            scored.append((over, step_ms, len(scored), choice))
            logger.debug("recompute: %s -> predicted step %.3f ms, %d bytes over the budget of %d",
                         choice.why, step_ms, over, self._budget_bytes)
        least_over = min(over for over, *_ in scored)
        tolerance = least_over + max(int(OVER_TOLERANCE * self._budget_bytes), 1)
        _, step_ms, _, best = min((s for s in scored if s[0] < tolerance), key=lambda s: (s[1], s[2]))
        best.why = f"{best.why}; predicted step {step_ms:.3f} ms, the least of {len(scored)} choices"
        return best

    def _predicted(self, trace: ActivationTrace) -> tuple[float, int]:
        """The step ``trace`` predicts at its budget (planned for its floor where that is
        higher) and the bytes its plan stays over the budget."""
        from hyperpar.offload.planning import simulate

        budget = trace.memory_limit_bytes
        with deficit_warnings_muted():
            if self.config.plan_for is not None:
                from hyperpar.offload.projection import HostCosts, get_device  # beside planning
                from hyperpar.offload.projection.levers import project_at_budget

                # at plain's host cost per op: copies must hide behind the device's work, not
                # behind the replay's own host overhead (a choice that hides them only there
                # is one faster host away from waiting on the link)
                host = HostCosts(replay_us=HostCosts().plain_us)
                projection, floor = project_at_budget(trace, get_device(self.config.plan_for), host, budget)
                return projection.replay.step_us / 1e3, max(floor - budget, 0) + projection.deficit_bytes
            floor = budget_floor(trace).floor_bytes
            planned = replace(trace, memory_limit_bytes=max(floor, budget))
            with arrays_given(planned, trace_arrays(planned)):
                schedule = self.config.resolved_planner().build(planned)
                return (float(simulate(planned, schedule).predicted_step_ms),
                        max(floor - budget, 0) + schedule.deficit_bytes)


def _on_device(trace: ActivationTrace, arrays: TraceArrays, device_name: str, budget_bytes: int
               ) -> tuple[TraceArrays, float, float, float]:
    """The trace's op times on ``device_name``'s model (each op the longer of plain's host cost
    and its roofline time), its plain compute and the copy wait an offload-only plan leaves
    there (``projection.project``), and its link bandwidth."""
    from hyperpar.offload.projection import HostCosts, get_device, project  # beside planning, not below

    device, host = get_device(device_name), HostCosts()
    projection = project(trace, device, host, budget_bytes)
    device_ms = np.maximum(np.asarray(projection.device_us, dtype=np.float64), host.plain_us) / 1e3
    return (replace(arrays, duration_ms=device_ms), projection.plain.step_us / 1e3,
            projection.replay.copy_wait_us / 1e3, device.link_gbps)
