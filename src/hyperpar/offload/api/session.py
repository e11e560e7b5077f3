"""OffloadSession: the context manager a training step runs in.

The first clean exit turns the warmup trace into a schedule; later entries replay it.
Whatever happens inside, every evicted storage still alive is paged back in on exit, so
the tensors the user keeps are ordinary tensors afterwards.

A training loop may cycle through a few different steps (gradient accumulation: the first
micro-step creates ``.grad``, the next ones add into it). The session keeps up to
``MAX_PLANS`` plans keyed by the step's structure and learns which plan follows which: a
step that diverged from its predicted plan makes the session trace the step that takes
that place next time, after which the cycle replays without divergence.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from hyperpar.offload.api.config import OffloadConfig
from hyperpar.offload.capture import (
    ExecutorBase,
    OffloadDispatchMode,
    ReplayExecutor,
    ReplayProgram,
    WarmupExecutor,
)
from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.planning.floor import BudgetFloor, budget_floor
from hyperpar.offload.planning.sweep import deficit_warnings_muted
from hyperpar.offload.runtime import (
    CopyEngine,
    HostPool,
    OpTimer,
    ResidencyManager,
    StepTimeline,
    make_copy_engine,
    probe_link,
)

logger = logging.getLogger(__name__)
_ACTIVE: contextvars.ContextVar[OffloadSession | None] = contextvars.ContextVar(
    "hyperpar_offload_session", default=None
)


def _outside_an_op() -> str:
    return "outside an op"


MAX_PLANS = 4
_UNKNOWN = object()  # no step has followed this plan yet


@dataclass(eq=False)
class _Plan:
    signature: int
    trace: ActivationTrace
    schedule: ResidencySchedule
    program: ReplayProgram
    predicted_ms: float
    floor: BudgetFloor


def _signature(trace: ActivationTrace, keys: list[object]) -> int:
    """Everything replay binds by (ops, outputs, storage accesses and sizes), not timings."""
    return hash((
        tuple(keys),
        tuple((g.output_leaf_count, tuple(sorted(g.output_bindings.items())), g.output_meta)
              for g in trace.guides),
        tuple(op.accesses for op in trace.ops),
        tuple(sorted(trace.storage_sizes.items())),
    ))


class OffloadSession:
    def __init__(self, config: OffloadConfig | None = None) -> None:
        if config is None:
            config = OffloadConfig()
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"OffloadSession(config=...) needs an OffloadConfig, got {config!r}")
        self.config = config
        self.device = config.resolved_device()
        if self.device.type != "cpu":
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            if acc is None or acc.type != self.device.type:
                raise ValueError(f"OffloadConfig.device={config.device!r}: this machine has no such "
                                 f"accelerator (available: {acc})")
        self.phase = "warmup"
        self.trace: ActivationTrace | None = None
        self.schedule: ResidencySchedule | None = None
        self.last_report: StepReport | None = None
        self._plans: OrderedDict[int, _Plan] = OrderedDict()  # signature -> plan, oldest first
        self._next: dict[int, int | None] = {}  # plan -> the plan that followed it (None: trace)
        self._prev: int | None = None  # plan of the last clean, undiverged step
        self._came_from: int | None = None  # self._prev when the running step entered
        self._running: _Plan | None = None  # the plan the running replay follows
        self._pool = HostPool(config.offload_cap_bytes, pin_memory=self.device.type != "cpu")
        engine: CopyEngine = (make_copy_engine(self.device, config.copy_engine)
                              if isinstance(config.copy_engine, str) else config.copy_engine)
        self._manager = ResidencyManager(self.device, self._pool, engine, verify=config.verify)
        self._timer = OpTimer(self.device)
        self._record_timeline = config.timeline
        self._timeline: StepTimeline | None = None
        self.link_bandwidth: dict[str, object] | None = None
        self._executor: ExecutorBase | None = None
        self._mode: OffloadDispatchMode | None = None
        self._token: contextvars.Token[OffloadSession | None] | None = None
        self._t0 = 0.0
        self._budget_bytes = config.budget_bytes  # max_resident_fraction: resolved at the first trace
        self._said_below_floor = False

    @classmethod
    def get_active(cls) -> OffloadSession | None:
        return _ACTIVE.get()

    def held_bytes(self) -> int:
        """Host bytes held by the pool (in use or cached for reuse)."""
        return self._pool.held_bytes

    @property
    def copy_engine_name(self) -> str:
        return str(getattr(self._manager.engine, "name", type(self._manager.engine).__name__))

    def host_allocations(self) -> int:
        """New host allocations the pool has made so far (flat once the sizes repeat)."""
        return self._pool.allocations

    def export_chrome_trace(self, path: str | Path) -> Path:
        """Write the last replay's timeline (ops, D2H, H2D tracks) as Chrome trace JSON."""
        if self._timeline is None:
            raise RuntimeError(
                "export_chrome_trace: no replay timeline yet (replay steps record it when "
                "OffloadConfig(timeline=True))"
            )
        return self._timeline.write_chrome_trace(path)

    def tracked_storages(self) -> int:
        """Storages in the residency table (0 between steps)."""
        return len(self._manager.entries)

    # --- context manager ------------------------------------------------------------
    def __enter__(self) -> OffloadSession:
        if self._executor is not None:
            raise RuntimeError("this OffloadSession is already active: a session is not re-entrant")
        if _ACTIVE.get() is not None:
            raise RuntimeError("another OffloadSession is active: sessions cannot be nested")
        m = self._manager
        m.clear()
        m.bytes_d2h = m.bytes_h2d = m.demand_faults = m.cap_hits = 0
        self._pool.new_step()
        budget = self._budget_bytes
        plan = self._choose()
        self._came_from, self._running = self._prev, plan
        if plan is not None:
            executor: ExecutorBase = ReplayExecutor(m, self.device, budget, plan.program,
                                                    self.config.on_divergence)
            if self._record_timeline:
                executor.timer = self._timer
        else:
            executor = WarmupExecutor(m, self.device, budget)
            executor.timer = self._timer
        m.describe_op = executor.describe_op
        self._executor = executor
        self._mode = OffloadDispatchMode(executor)
        self._token = _ACTIVE.set(self)
        self._sync()
        m.engine.begin_step()
        if executor.timer is not None:
            executor.timer.begin_step()
        self._t0 = time.perf_counter()
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        executor, mode = self._executor, self._mode
        assert executor is not None and mode is not None
        clean = exc_type is None
        try:
            mode.__exit__(None, None, None)
        finally:
            self._reset_active()
        pending: BaseException | None = None
        try:
            self._sync()
            step_ms = (time.perf_counter() - self._t0) * 1e3
            report, pending = executor.finish(clean, step_ms)
            self._manager.engine.end_step()
            report.exposed_wait_ms = self._manager.engine.exposed_wait_ms()
            if clean:
                self._after_clean_step(executor, report)
        except BaseException as cleanup_error:
            if clean:
                pending = cleanup_error
            else:
                logger.exception("cleanup after a failed offload step failed; re-raising the original error")
        finally:
            self._manager.clear()
            self._manager.describe_op = _outside_an_op  # no reference to the finished executor
            if not clean or pending is not None:
                self._pool.trim()
            self._executor = None
            self._mode = None
        if pending is not None:
            raise pending
        return False

    def _choose(self) -> _Plan | None:
        """The plan the next step should replay, or None to trace it."""
        if self._prev is None or self._prev not in self._plans:
            return None
        nxt = self._next.get(self._prev, _UNKNOWN)
        if nxt is _UNKNOWN:  # assume steps repeat until one diverges
            return self._plans[self._prev]
        return None if nxt is None else self._plans.get(nxt)  # type: ignore[arg-type]

    def _after_clean_step(self, executor: ExecutorBase, report: StepReport) -> None:
        if isinstance(executor, WarmupExecutor):
            link = probe_link(self.device, self._manager.engine)
            self.link_bandwidth = link.as_dict()
            trace = executor.build_trace(link.d2h_gbps, link.h2d_gbps)
            if self.config.max_resident_fraction is not None and not self._plans:
                self._budget_bytes = self.config.budget_for_peak(trace.peak_bytes_without_offload())
                trace.memory_limit_bytes = self._budget_bytes
            signature = _signature(trace, executor.keys)
            plan = self._plans.get(signature)
            if plan is None:
                plan = self._new_plan(signature, trace, executor.keys)
            self._plans.move_to_end(signature)
            self._learn(signature)
            report.predicted_step_ms = None
        elif isinstance(executor, ReplayExecutor):
            plan = self._running
            assert plan is not None
            report.predicted_step_ms = plan.predicted_ms
            if executor.timer is not None:
                self._timeline = executor.timeline(self._manager.engine.spans())
            if report.diverged_at is None:
                self._plans.move_to_end(plan.signature)
                self._learn(plan.signature)
            elif self.config.on_divergence == "retrace":
                # Trace the step that comes in this place next time; the one after this
                # diverged step is traced too, since nothing is known about where we are.
                if self._came_from is not None:
                    self._next[self._came_from] = None
                self._prev = None
        else:
            plan = None
        if plan is not None:
            self.trace, self.schedule = plan.trace, plan.schedule
            plan.floor.annotate(report)
        if not (isinstance(executor, ReplayExecutor) and report.diverged_at is not None
                and self.config.on_divergence == "raise"):
            self.phase = "warmup" if self._choose() is None else "replay"
        self.last_report = report

    def _new_plan(self, signature: int, trace: ActivationTrace, keys: list[object]) -> _Plan:
        floor = budget_floor(trace)
        below_floor = floor.floor_bytes > trace.memory_limit_bytes
        if below_floor and not self._said_below_floor:  # said once per session, the planners stay quiet
            logger.warning("%s", floor.below_floor_message(trace.memory_limit_bytes))
            self._said_below_floor = True
        with deficit_warnings_muted() if below_floor else contextlib.nullcontext():
            schedule = self.config.resolved_planner().build(trace)
        predicted = schedule.notes.get("predicted_step_ms")
        if not isinstance(predicted, (int, float)) or isinstance(predicted, bool):
            from hyperpar.offload.planning import simulate  # planning sits beside capture

            predicted = simulate(trace, schedule).predicted_step_ms
        plan = _Plan(signature, trace, schedule, ReplayProgram.build(trace, schedule, keys),
                     float(predicted), floor)
        self._plans[signature] = plan
        while len(self._plans) > MAX_PLANS:
            old, _ = self._plans.popitem(last=False)
            self._next.pop(old, None)
            for key in [k for k, v in self._next.items() if v == old]:
                del self._next[key]
        return plan

    def _learn(self, signature: int) -> None:
        if self._came_from is not None and self._came_from in self._plans:
            self._next[self._came_from] = signature
        self._prev = signature

    def _reset_active(self) -> None:
        token, self._token = self._token, None
        try:
            if token is not None:
                _ACTIVE.reset(token)
        except ValueError:  # exited in another context than the one it entered
            _ACTIVE.set(None)

    def _sync(self) -> None:
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()
