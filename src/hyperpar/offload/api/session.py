"""OffloadSession: the context manager a training step runs in.

The first clean exit turns the warmup trace into a schedule; later entries replay it.
Whatever happens inside, every evicted storage still alive is paged back in on exit, so
the tensors the user keeps are ordinary tensors afterwards.

Plans are keyed by the step's *structure* (ops, which storage each input is, output
dtypes and ranks), not by sizes: a step with another sequence length or batch size replays
its structure's plan. Each structure keeps plans for a few sizes (``size_bucket`` of its
first activation, about 19 % apart), each planned for the largest step seen of that size;
a step of a size not planned yet replays the nearest larger plan (or the largest one, with
replay evicting beyond it when it holds more than the budget), and its measured sizes are
planned right after it, without a warmup.

A training loop may cycle through a few different structures (gradient accumulation: the
first micro-step creates ``.grad``, the next ones add into it). The session keeps up to
``MAX_STRUCTURES`` and learns which follows which; a step that turns out to be another known
structure switches to it, and one that is new finishes on the online path and traces
itself, so its plan exists at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from types import TracebackType

import numpy as np
import torch

from hyperpar.offload.api.config import OffloadConfig
from hyperpar.offload.api.fast_steps import FastSteps
from hyperpar.offload.api.plans import FastStep, Plan, Structure, signature_of
from hyperpar.offload.api.recompute_steps import RecomputeSteps
from hyperpar.offload.capture import (
    ExecutorBase,
    OffloadDispatchMode,
    OffloadDivergenceError,
    ReplayExecutor,
    ReplayProgram,
    WarmupExecutor,
    current_offload_mode,
    hold_step_hooks,
    host_reads,
    size_bucket,
)
from hyperpar.offload.capture.fast.fast_replay import FallbackExecutor
from hyperpar.offload.capture.fast.saved_tensor_guard import SavedTensorGuard
from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.ir.packed import PackedTrace
from hyperpar.offload.ir.packed_schedule import PackedSchedule, last_copy_in
from hyperpar.offload.ir.packed_view import trace_view
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.planning import gc_pause
from hyperpar.offload.planning.arrays import (
    TraceArrays,
    arrays_given,
    kept_and_movable_peak,
    packed_trace_arrays,
)
from hyperpar.offload.planning.deficit_warnings import deficit_warnings_muted
from hyperpar.offload.planning.floor import BudgetFloor, budget_floor
from hyperpar.offload.planning.simulate import SimResult
from hyperpar.offload.planning.tails import plan_with_tails
from hyperpar.offload.runtime import (
    CopyEngine,
    HostPool,
    OpTimer,
    ResidencyManager,
    StepTimeline,
    make_copy_engine,
    probe_link,
)
from hyperpar.offload.runtime.disk_store import ALIGN as DISK_ALIGN
from hyperpar.offload.runtime.host_pool import ALIGN_BYTES

logger = logging.getLogger(__name__)


def _outside_an_op() -> str:
    return "outside an op"


MAX_STRUCTURES = 4
MAX_SIZES = 16  # plans per structure
# A step of a planned size whose activations are this much larger in total is planned again.
REPLAN_GROWTH = 1.01
_UNKNOWN = object()  # no step has followed this structure yet
# A replay's totals its Chrome trace carries: what it offloaded (D2H, H2D), rebuilt in
# backward instead of keeping, and what stayed on the device against the budget.
STEP_TOTALS = ("bytes_d2h", "bytes_h2d", "bytes_recomputed", "peak_resident_bytes", "budget_bytes",
               "bytes_to_disk", "bytes_from_disk", "peak_host_bytes")  # the three tiers


class OffloadSession(FastSteps, RecomputeSteps):
    def __init__(self, config: OffloadConfig | None = None) -> None:
        if config is None:
            config = OffloadConfig()
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"OffloadSession(config=...) needs an OffloadConfig, got {config!r}")
        self.config = config
        self.phase = "warmup"
        self._current: Plan | None = None  # the plan of the last clean step
        self.last_report: StepReport | None = None
        self._structures: OrderedDict[int, Structure] = OrderedDict()  # signature -> it, oldest first
        self._next: dict[int, int | None] = {}  # structure -> the one that followed it (None: trace)
        self._prev: int | None = None  # structure of the last clean step
        self._came_from: int | None = None  # self._prev when the running step entered
        self._running: Plan | None = None  # the plan the running replay follows
        self._record_timeline = config.timeline
        self._timeline: StepTimeline | None = None
        self.link_bandwidth: dict[str, object] | None = None
        self._executor: ExecutorBase | None = None
        self._fast: FastStep | None = None  # the running step takes the fast path
        self._packs: SavedTensorGuard | None = None  # records a mode step's saved tensors
        self._mode: OffloadDispatchMode | None = None
        self._t0 = 0.0
        self._budget_bytes = config.budget_bytes  # max_resident_fraction: resolved at the first trace
        self._said_below_floor = False
        self._said_disk_tier = False
        self._disk_plans = True  # plans tell the disk tier which copies must go (off: any may)
        self._said_below_fast_floor = False
        self._recompute_init()
        self._hooks_held = False
        self._bind_device(config.resolved_device())

    def _bind_device(self, device: torch.device) -> None:
        """The device the session tracks, its copy engine and host pool."""
        if device.type != "cpu":
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            if acc is None or acc.type != device.type:
                raise ValueError(f"OffloadConfig.device={self.config.device!r}: this machine has no such "
                                 f"accelerator (available: {acc})")
        config = self.config
        self.device = device
        host_budget = config.host_budget_bytes
        cap = config.offload_cap_bytes if host_budget is None else min(config.offload_cap_bytes, host_budget)
        # with a disk tier, page-aligned slabs: direct I/O moves them without a staging copy
        self._pool = HostPool(cap, pin_memory=device.type != "cpu",
                              align=ALIGN_BYTES if host_budget is None else DISK_ALIGN)
        engine: CopyEngine = (make_copy_engine(device, config.copy_engine)
                              if isinstance(config.copy_engine, str) else config.copy_engine)
        old = getattr(self, "_manager", None)
        if old is not None and old.tier is not None:
            old.tier.close()
        self._manager = ResidencyManager(device, self._pool, engine, verify=config.verify)
        if host_budget is not None:
            assert config.disk_dir is not None
            self._manager.use_disk(os.fspath(config.disk_dir), host_budget)
        self._timer = OpTimer(device)

    @property
    def trace(self) -> ActivationTrace | None:
        """The trace of the last clean step's plan (rebuilt from its packed form when asked)."""
        return None if self._current is None else self._current.trace

    @property
    def schedule(self) -> ResidencySchedule | None:
        """The schedule of the last clean step's plan."""
        return None if self._current is None else self._current.schedule

    @classmethod
    def get_active(cls) -> OffloadSession | None:
        """The session whose step runs in this thread (also in autograd's backward threads,
        which inherit the step's dispatch mode), or None."""
        mode = current_offload_mode()
        return None if mode is None else mode.session  # type: ignore[return-value]

    def held_bytes(self) -> int:
        """Host bytes held by the pool (in use or cached for reuse)."""
        return self._pool.held_bytes

    @property
    def copy_engine_name(self) -> str:
        return str(getattr(self._manager.engine, "name", type(self._manager.engine).__name__))

    def host_allocations(self) -> int:
        """New host allocations the pool has made so far (flat once the sizes repeat)."""
        return self._pool.allocations

    def keep_on_device(self, *tensors: torch.Tensor) -> None:
        """Keep these activations of the running step on the device until the step ends.

        Needed only to share an activation with another thread while the step runs (reads
        from the step's own thread are handled); outside a step it does nothing.
        """
        executor = self._executor
        if executor is None or executor.closed:
            return
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"keep_on_device takes tensors, got {type(t).__name__}")
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            executor.read_behind_dispatcher(storage)

    def export_chrome_trace(self, path: str | Path) -> Path:
        """Write the last replay's timeline (ops, D2H, H2D tracks) as Chrome trace JSON, with
        its step's totals (``STEP_TOTALS``: offloaded, rebuilt in backward, what stayed) in
        ``otherData["step"]`` and on a marker: a rebuilt module call shows only as more ops."""
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
        if current_offload_mode() is not None:
            raise RuntimeError("another OffloadSession is active: sessions cannot be nested")
        if self.config.device is None and not self._structures and self.last_report is None:
            device = self.config.resolved_device()  # bound at the first step, not when built
            if device != self.device:
                self._bind_device(device)
        if not self._hooks_held:  # torch wrappers, kept while this session lives
            hold_step_hooks(self)
            self._hooks_held = True
        m = self._manager
        m.clear()
        m.bytes_d2h = m.bytes_h2d = m.demand_faults = m.cap_hits = 0
        self._pool.new_step()
        budget = self._budget_bytes
        plan = self._choose()
        self._begin_tier(plan)
        self._came_from, self._running = self._prev, plan
        decides = self._decides(plan)  # (lengths vary: the first saved tensor picks the path)
        if plan is not None and not decides and self._fast_ok(plan):
            self._recompute_enter(None)
            try:
                self._start_fast(plan)
            except BaseException:
                self._recompute_exit(check=False)
                raise
            return self
        if plan is not None:
            others = tuple(p.program for st in reversed(self._structures.values())
                           for p in [st.last, *st.sizes.values()] if p is not plan)
            executor: ExecutorBase = ReplayExecutor(m, self.device, budget, plan.program,
                                                    self.config.on_divergence, others)
            if self._record_timeline:
                executor.timer = self._timer
        else:
            executor = WarmupExecutor(m, self.device, budget)
            executor.timer = self._timer
        m.describe_op = executor.describe_op
        self._executor = executor
        self._mode = mode = OffloadDispatchMode(executor, self)
        entered = False
        try:
            host_reads.step_started(executor)
            self._sync()
            m.engine.begin_step()
            if executor.timer is not None:
                executor.timer.begin_step()
            self._recompute_enter(executor)
            self._t0 = time.perf_counter()
            mode.__enter__()
            entered = True
            if self.config.fast_replay:  # on every step (saved-tensor hooks change the ops autograd
                self._packs = SavedTensorGuard(log=self._event_log(executor),  # runs: no ``detach``
                                               hand_off=self._hand_off if decides else None).__enter__()
                # per saved output)
        except BaseException:  # (an interrupt, say): no mode or hook left behind, the session usable
            self._undo_enter(executor, entered)
            raise
        if isinstance(executor, WarmupExecutor):
            gc_pause.hold()  # the trace is many small acyclic objects: collect after the step
        return self

    def _begin_tier(self, plan: Plan | None) -> None:
        """The disk tier's step, in ``plan``'s order of copies back (by age without a plan)."""
        tier = self._manager.tier
        if tier is None:
            return
        if plan is None:
            tier.begin_step(None)
            return
        if plan.copy_in is None:
            from hyperpar.offload.planning.disk_plan import plan_disk  # planning beside capture
            from hyperpar.offload.planning.host_tier import host_peak

            plan.copy_in = last_copy_in(plan.packed_schedule)
            plan.host_peak = host_peak(plan.trace, plan.schedule, self._pool.align)
            if plan.host_peak > tier.budget_bytes and self._disk_plans:
                plan.disk_plan = plan_disk(plan.trace, plan.schedule, tier.budget_bytes, self._pool.align)
        disk = plan.disk_plan
        tier.begin_step(plan.copy_in, ahead=plan.host_peak > tier.budget_bytes,
                        must_go=None if disk is None else disk.must_go)

    def close(self) -> None:
        """Give back what the session holds between steps: host slabs, the disk tier's file
        (unlinked) and its I/O thread. The session stays usable; a later step allocates again."""
        if self._executor is not None or self._fast is not None:
            raise RuntimeError("OffloadSession.close(): a step of this session is running; close it "
                               "after the `with` block")
        self._manager.clear()
        self._pool.trim()
        if self._manager.tier is not None:
            self._manager.tier.close()

    def _undo_enter(self, executor: ExecutorBase, entered: bool) -> None:
        """Undo what a mode step's ``__enter__`` did: it failed, or the step goes fast from its
        first saved tensor (``_hand_off``; the executor has moved nothing)."""
        executor.closed = True  # its region graphs' hooks do nothing more
        executor.release_region_graphs()
        packs, self._packs = self._packs, None
        try:
            if packs is not None:
                packs.__exit__()
            if entered and self._mode is not None:
                self._mode.__exit__(None, None, None)
            self._recompute_exit(check=False)
        finally:
            self._manager.clear()
            host_reads.step_ended(executor)
            if executor.timer is not None:
                executor.timer.end_step()
            self._manager.describe_op = _outside_an_op
            self._executor = self._mode = None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        # the modules' own forward back, however the step ended; a rebuilt call that gave other
        # bytes than forward fails the step as an error inside it would
        mismatch = self._recompute_exit(check=exc_type is None)
        if mismatch is not None:
            self._exit(type(mismatch), mismatch, None)
            raise mismatch
        return self._exit(exc_type, exc, tb)

    def _exit(self, exc_type: type[BaseException] | None, exc: BaseException | None,
              tb: TracebackType | None) -> bool:
        fast, packs = self._fast, self._packs
        self._fast = self._packs = None
        finish_error: BaseException | None = None
        if fast is not None:
            fast.guard.__exit__()
            if fast.moving is not None:
                try:
                    fast.moving.finish()
                except BaseException as error:  # (a page-in with no host room): the step fails, and
                    # the cleanup below still runs: no dispatch mode left entered, no file left
                    if exc_type is None:
                        exc_type, exc, finish_error = type(error), error, error
                    else:
                        logger.exception("cleanup after a failed offload step failed; re-raising the "
                                         "original error")
            if self._executor is None:  # followed its plan (or failed) without a fallback
                self._exit_fast(fast, exc_type is None)
                if exc_type is not None:
                    self._pool.trim()
                    if self._manager.tier is not None:
                        self._manager.tier.close_file()  # nothing of a failed step left on disk
                if finish_error is not None:
                    raise finish_error
                return False
        if packs is not None:
            packs.__exit__()
        executor, mode = self._executor, self._mode
        if executor is None and fast is None:  # a hand-off to the fast path failed: nothing is left
            return False
        assert executor is not None and mode is not None
        clean = exc_type is None
        mode.__exit__(None, None, None)
        pending: BaseException | None = None
        try:
            self._sync()
            step_ms = (time.perf_counter() - self._t0) * 1e3
            report, pending = executor.finish(clean, step_ms)
            self._manager.engine.end_step()
            report.exposed_wait_ms = self._manager.engine.exposed_wait_ms()
            if clean:
                self._saved_in_backward = packs is not None and packs.saved_in_backward
                self._after_clean_step(executor, report)
                if packs is not None:
                    self._learn_packs(executor, packs)
                    current = self._current  # its fast-path floor may be known from this step on
                    if current is not None and current.fast_floor is not None:
                        report.fast_path_floor_bytes = current.fast_floor.floor_bytes
            elif isinstance(exc, OffloadDivergenceError) and isinstance(executor, ReplayExecutor):
                self._forget_successor()  # on_divergence="raise": trace this step's kind next time
        except BaseException as cleanup_error:
            if clean:
                pending = cleanup_error
            else:
                logger.exception("cleanup after a failed offload step failed; re-raising the original error")
        finally:
            try:
                self._manager.clear()
            finally:  # other threads' reads stay guarded until every storage is back and forgotten
                host_reads.step_ended(executor)
                if isinstance(executor, WarmupExecutor):
                    gc_pause.release()
            self._manager.describe_op = _outside_an_op  # no reference to the finished executor
            if executor.timer is not None:
                executor.timer.end_step()
            if not clean or pending is not None:
                self._pool.trim()
                if self._manager.tier is not None:
                    self._manager.tier.close_file()  # nothing of a failed step left on disk
            self._executor = None
            self._mode = None
        if pending is None:
            pending = finish_error
        if pending is not None:
            if isinstance(pending, OffloadDivergenceError):
                self._forget_successor()
            raise pending
        return False

    def _choose(self) -> Plan | None:
        """The plan the next step should replay, or None to trace it."""
        if self._prev is None or self._prev not in self._structures:
            return None
        nxt = self._next.get(self._prev, _UNKNOWN)
        if nxt is _UNKNOWN:  # assume steps repeat until one diverges
            return self._structures[self._prev].last
        structure = None if nxt is None else self._structures.get(nxt)  # type: ignore[arg-type]
        return None if structure is None else structure.last

    def _forget_successor(self) -> None:
        """The step after ``_came_from`` is not what was predicted: trace it next time."""
        if self._came_from is not None:
            self._next[self._came_from] = None
        self.phase = "warmup" if self._choose() is None else "replay"

    def _after_clean_step(self, executor: ExecutorBase, report: StepReport) -> None:
        if isinstance(executor, FallbackExecutor):
            self._after_fallback(executor, report)
            return
        trace: ActivationTrace | None = None
        packed: PackedTrace | None = None
        arrays: TraceArrays | None = None
        keys: list[object] = []
        if isinstance(executor, (WarmupExecutor, ReplayExecutor)):
            link = probe_link(self.device, self._manager.engine)
            if self.link_bandwidth is None:
                self.link_bandwidth = link.as_dict()
            if isinstance(executor, WarmupExecutor):  # recorded packed: no op objects
                packed = executor.build_packed(link.d2h_gbps, link.h2d_gbps)
                trace = trace_view(packed)
            else:
                trace = executor.build_trace(link.d2h_gbps, link.h2d_gbps)
                packed = None if trace is None else PackedTrace(trace)
            keys = executor.keys
            if trace is not None and packed is not None:
                if self.config.max_resident_fraction is not None:  # a budget on the movable bytes
                    trace.reserve_retained = packed.reserve_retained = True
                arrays = packed_trace_arrays(trace, packed)
                if self.config.max_resident_fraction is not None and not self._structures:
                    kept, movable_peak = kept_and_movable_peak(arrays, trace.retained_sids)
                    self._budget_bytes = self.config.budget_for_peak(movable_peak, kept)
                    trace.memory_limit_bytes = packed.memory_limit_bytes = self._budget_bytes
        if isinstance(executor, ReplayExecutor):
            assert self._running is not None
            report.predicted_step_ms = self._running.predicted_ms
            if executor.timer is not None:
                tier = self._manager.tier
                self._timeline = executor.timeline(self._manager.engine.spans()
                                                   + ([] if tier is None else tier.spans))
        if trace is not None and packed is not None:  # a warmup, or a replay that diverged and traced itself
            signature = signature_of(packed, keys)
            structure = self._structures.get(signature)
            if structure is None:
                plan = self._new_plan(signature, trace, keys, packed, arrays)
            else:  # a known structure at sizes of its own: plan them
                plan = self._size_plan(structure, signature, trace, packed, arrays)
        else:  # the plan it ended on (it may have switched to another known one)
            assert isinstance(executor, ReplayExecutor)
            plan = self._after_replay(executor)
            report.predicted_step_ms = plan.predicted_ms
        self._structures.move_to_end(plan.signature)
        self._structures[plan.signature].last = plan
        self._learn(plan.signature)
        self._current = plan
        plan.annotate(report)
        if trace is None and report.peak_resident_bytes > report.budget_bytes:
            # over budget: say whether the budget was feasible at this step's own sizes (its
            # plan may be another size's, or the larger of two sizes at each storage)
            assert isinstance(executor, ReplayExecutor)
            self._measured_floor(executor, plan).annotate(report)
        if isinstance(executor, WarmupExecutor) and trace is not None and arrays is not None:
            self._recompute_gate(trace, arrays, plan.predicted_ms, bool(plan.program.region_accesses))
        elif self._module_spans is not None and isinstance(executor, ReplayExecutor):
            if executor.diverged_at is None:
                self._choose_recompute(plan.signature, plan.trace,
                                       packed_trace_arrays(plan.trace, plan.packed), plan.predicted_ms)
            else:
                self._module_spans = None  # (another step than the plan's: try on the next one)
        self._recompute_report(report)
        if isinstance(executor, ReplayExecutor) and executor.timer is not None and self._timeline is not None:
            self._timeline.step = {name: int(getattr(report, name)) for name in STEP_TOTALS}
        self.phase = "warmup" if self._choose() is None else "replay"
        self.last_report = report

    def _after_replay(self, executor: ReplayExecutor) -> Plan:
        """The plan a replay ended on; a step of a size with no plan yet, or larger than its
        plan's, has its measured sizes planned now (no warmup needed)."""
        program = executor.program
        structure = next(st for st in self._structures.values()
                         if any(p.program is program for p in st.sizes.values()))
        plan = next(p for p in structure.sizes.values() if p.program is program)
        nbytes, size_sid = executor.table.nbytes, plan.packed.size_sid
        bucket = size_bucket(nbytes[0] if plan.packed.size_of(0, -1) >= 0 else 0)  # sid 0 as measured
        own = structure.sizes.get(bucket)
        if own is None or sum(map(nbytes.__getitem__, size_sid)) > own.total_bytes * REPLAN_GROWTH:
            sizes = {sid: nbytes[sid] for sid in size_sid}
            if own is not None:  # plan for the larger of the two at each storage
                planned = own.packed.storage_sizes()
                sizes = {sid: max(n, planned.get(sid, 0)) for sid, n in sizes.items()}
            plan = self._size_plan(structure, plan.signature, self._resized(plan.trace, sizes))
        return plan

    def _measured_floor(self, executor: ReplayExecutor, plan: Plan) -> BudgetFloor:
        """The floor at the storage sizes the step measured (the plan's structure, its sids)."""
        nbytes = executor.table.nbytes
        trace = self._resized(plan.trace, {sid: nbytes[sid] for sid in plan.packed.size_sid})
        arrays = packed_trace_arrays(trace, plan.packed)
        size = np.array([nbytes[sid] for sid in arrays.sids.tolist()], dtype=np.int64)
        arrays = replace(arrays, size=size, access_size=size[np.searchsorted(arrays.sids, arrays.access_sid)])
        with arrays_given(trace, arrays):
            return budget_floor(trace)

    @staticmethod
    def _resized(trace: ActivationTrace, sizes: dict[int, int]) -> ActivationTrace:
        """The same structure at other sizes. Op durations stay; the links are scaled by the
        size ratio instead, so copies take the same share of the step as they did."""
        ratio = max(sum(sizes.values()), 1) / max(sum(trace.storage_sizes.values()), 1)
        return replace(trace, storage_sizes=sizes, d2h_bandwidth_gbps=trace.d2h_bandwidth_gbps * ratio,
                       h2d_bandwidth_gbps=trace.h2d_bandwidth_gbps * ratio)

    def _size_plan(self, structure: Structure, signature: int, trace: ActivationTrace,
                   packed: PackedTrace | None = None, arrays: TraceArrays | None = None) -> Plan:
        base = next(iter(structure.sizes.values())).program
        plan = self._plan(signature, trace, structure.keys, base, packed, arrays)
        bucket = plan.program.bucket
        structure.sizes.pop(bucket, None)
        structure.sizes[bucket] = plan
        while len(structure.sizes) > MAX_SIZES:
            structure.sizes.pop(next(iter(structure.sizes)))
        return plan

    def _new_plan(self, signature: int, trace: ActivationTrace, keys: list[object], packed: PackedTrace,
                  arrays: TraceArrays | None) -> Plan:
        plan = self._plan(signature, trace, keys, None, packed, arrays)
        self._structures[signature] = Structure(keys, {plan.program.bucket: plan}, plan)
        while len(self._structures) > MAX_STRUCTURES:
            old, _ = self._structures.popitem(last=False)
            self._next.pop(old, None)
            for key in [k for k, v in self._next.items() if v == old]:
                del self._next[key]
        return plan

    def _plan(self, signature: int, trace: ActivationTrace, keys: list[object],
              structure: ReplayProgram | None, packed: PackedTrace | None = None,
              arrays: TraceArrays | None = None, quiet: bool = False) -> Plan:
        """``packed``: the trace packed already (and ``arrays``, its arrays), else packed here;
        ``quiet``: no word on a budget below this trace's floor (a re-plan with more pinned)."""
        from hyperpar.offload.planning import simulate  # planning sits beside capture
        from hyperpar.offload.planning.prediction import kept_simulation, simulations_kept

        like = None if structure is None else structure.packed
        if packed is None:
            packed, arrays = PackedTrace(trace, like), None
        elif like is not None and packed.structure == like.structure:
            packed.structure = like.structure  # plans of one structure share its columns
        if arrays is None:
            arrays = packed_trace_arrays(trace, packed)
        # The floor, the planner and the simulator share one set of arrays, made from the
        # packed trace; the planner's own simulation of its schedule is reused.
        with arrays_given(trace, arrays):
            floor = budget_floor(trace)
        below_floor = floor.floor_bytes > trace.memory_limit_bytes
        if below_floor and not self._said_below_floor and not quiet:  # said once per session
            logger.warning("%s", floor.below_floor_message(trace.memory_limit_bytes))
            self._said_below_floor = True

        def plan_once(trace: ActivationTrace, arrays: TraceArrays) -> tuple[ResidencySchedule, SimResult]:
            with arrays_given(trace, arrays), simulations_kept() as sims:
                schedule = self.config.resolved_planner().build(trace)
                return schedule, kept_simulation(sims, schedule) or simulate(trace, schedule)

        # Below the floor, plan for the floor: a planner chasing an unreachable budget moves
        # more than any step needs and waits for it (its peak can pass the unplanned one).
        # The plan's trace may mark tails; ``packed`` keeps the recorded one.
        # With ``plan_for``, the planner sees the op times and link of that device's model.
        recorded = trace
        planned, plan_arrays = self._for_device(trace, arrays)
        if below_floor:
            planned = replace(planned, memory_limit_bytes=floor.floor_bytes)
        with deficit_warnings_muted() if below_floor or quiet else contextlib.nullcontext():
            planned, schedule, sim = plan_with_tails(planned, plan_arrays, plan_once)
        if planned is not recorded:  # the plan's trace: tails marked, the budget and link as given
            trace = replace(planned, memory_limit_bytes=recorded.memory_limit_bytes,
                            d2h_bandwidth_gbps=recorded.d2h_bandwidth_gbps,
                            h2d_bandwidth_gbps=recorded.h2d_bandwidth_gbps)
        predicted = schedule.notes.get("predicted_step_ms")
        if not isinstance(predicted, (int, float)) or isinstance(predicted, bool):
            predicted = sim.predicted_step_ms
        packed_schedule = PackedSchedule(schedule)
        if self._manager.tier is not None and not self._said_disk_tier and not quiet:
            self._say_disk_tier(trace, schedule, float(predicted), sim)
        resident = sim.resident_bytes  # the device's bytes, without the budget's reserve
        if arrays.reserve_bytes is not None:
            resident = (np.asarray(resident, dtype=np.int64) - arrays.reserve_bytes).tolist()
        program = ReplayProgram.build(trace, schedule, keys, resident, structure, packed,
                                      packed_schedule, floor.floor_bytes)
        kept, movable_peak = kept_and_movable_peak(arrays, trace.retained_sids)
        return Plan(signature, packed, packed_schedule, program, float(predicted),
                     sum(trace.storage_sizes.values()), floor, kept_bytes=kept,
                     movable_peak_bytes=movable_peak)

    def _say_disk_tier(self, trace: ActivationTrace, schedule: ResidencySchedule, step_ms: float,
                       sim: SimResult) -> None:
        """Once per session: the disk tier's work on the first plan, at the disk's bandwidth the
        tier measured so far (else the defaults), timed on the plan's predicted op times
        (``sim``), when the step would wait for it."""
        from hyperpar.offload.planning.host_tier import DEFAULT_READ_GBPS, DEFAULT_WRITE_GBPS, host_tier

        tier = self._manager.tier
        host_budget = self.config.host_budget_bytes
        assert tier is not None and host_budget is not None
        write = (tier.bytes_to_disk / (tier.write_s * 1e9) if tier.write_s > 0 and tier.bytes_to_disk
                 else DEFAULT_WRITE_GBPS)
        read = (tier.bytes_from_disk / (tier.read_s * 1e9) if tier.read_s > 0 and tier.bytes_from_disk
                else DEFAULT_READ_GBPS)
        try:
            said = host_tier(trace, schedule, host_budget, write, read, timeline=sim).warning(step_ms)
        except Exception as exc:  # an estimate for a warning never fails a step
            logger.debug("disk tier estimate failed: %s", exc)
            return
        if said is not None:
            logger.warning("%s", said)
            self._said_disk_tier = True

    def _for_device(self, trace: ActivationTrace, arrays: TraceArrays) -> tuple[ActivationTrace, TraceArrays]:
        """The trace and arrays the planner sees: as measured, or with ``plan_for`` set, each
        op's time on that device's model (its roofline time, at least the replay's host cost
        per op) and that device's link, so the plan is the one that device would run (the
        same ops and storages: it runs here unchanged, bitwise)."""
        if self.config.plan_for is None:
            return trace, arrays
        from hyperpar.offload.projection import HostCosts, device_op_ms, get_device  # beside planning

        device = get_device(self.config.plan_for)
        durations = device_op_ms(trace, device, HostCosts().replay_us)
        return (replace(trace, d2h_bandwidth_gbps=device.link_gbps, h2d_bandwidth_gbps=device.link_gbps),
                replace(arrays, duration_ms=durations))

    def _learn(self, signature: int) -> None:
        if self._came_from is not None and self._came_from in self._structures:
            self._next[self._came_from] = signature
        self._prev = signature

    def _sync(self) -> None:
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()
