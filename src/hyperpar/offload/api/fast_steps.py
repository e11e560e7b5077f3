"""The session's side of the fast path (``capture.fast.fast_replay``): when a step may take it,
what a departure switches to, and what the session learns from a fast or checked step."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import replace
from typing import Any

import torch

from hyperpar.offload.api.plans import FastStep, Plan, Structure
from hyperpar.offload.capture import ExecutorBase, OffloadDispatchMode, ReplayExecutor, host_reads
from hyperpar.offload.capture.checked.replay_program import size_bucket
from hyperpar.offload.capture.fast.fast_moves import MovingStep
from hyperpar.offload.capture.fast.fast_replay import FallbackExecutor
from hyperpar.offload.capture.fast.fast_schedule import EventLog, MoveSchedule, Refusal
from hyperpar.offload.capture.fast.saved_tensor_guard import Fingerprint, SavedTensorGuard, covers, covers_all
from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.ir.packed import PackedTrace
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.planning.arrays import TraceArrays, arrays_given, packed_trace_arrays, with_reads
from hyperpar.offload.planning.floor import budget_floor

logger = logging.getLogger("hyperpar.offload.api.session")

MAX_REFINEMENTS = 5  # re-plans of a plan, each keeping more storages on the device for the fast path
FAST_DEPARTURES = 2  # fast steps of a structure that departed, after which it stays checked
LEARN_STEPS = 4  # checked steps, at most, for a size's plan to learn its saved tensors
LEARN_BACKOFF = 2  # learning steps that missed their length: the fallbacks passed next grow so (1, 2, 4)
MAX_SIZE_MISSES = 3  # steps in a row no plan covered (none fast, nothing learned between): stay checked


class FastSteps:
    """Mixed into ``OffloadSession`` (its attributes are the session's)."""

    _structures: Any
    _plan: Any
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
    _recompute_report: Any
    _want_spans: bool  # the next step records module calls: a checked replay
    _said_below_fast_floor: bool
    _recompute: Any
    _undo_enter: Any
    _begin_tier: Any

    def _fast_ok(self, plan: Plan) -> bool:
        """Whether the step may take the fast path: a plan within the budget whose moves (if
        any) run at saved-tensor events, with the saved tensors of a clean checked replay to
        compare against."""
        return (self.config.fast_replay and bool(plan.packs) and not self._want_spans
                and not self.config.verify  # checksums are the checked path's: it checks every copy
                and not self._structures[plan.signature].to_learn
                and (not plan.moves or plan.move_schedule is not None)
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
        executor.missed = fast.missed
        if fast.moving is not None:  # Python held storages the plan released: plan with them kept
            executor.held_bytes, executor.held_sids = fast.moving.held_past_release, fast.moving.held_sids
            fast.moving.mode_evicts = True
            executor.fast_moves = fast.moving
        m.describe_op = executor.describe_op
        self._executor = executor
        self._mode = OffloadDispatchMode(executor, self)
        host_reads.step_started(executor)
        m.engine.begin_step()
        self._mode.__enter__()

    def _start_fast(self, plan: Plan) -> None:
        moving = self._moving_for(plan)
        guard = SavedTensorGuard(plan.packs, self._fall_back, moving=moving, other_size=self._other_size)
        guard.__enter__()
        self._fast = FastStep(plan, guard, time.perf_counter(), threading.get_ident(), moving)

    def _moving_for(self, plan: Plan) -> MovingStep | None:
        if not plan.moves:
            return None
        assert plan.move_schedule is not None
        self._manager.engine.begin_step()
        return MovingStep(plan.move_schedule, self._manager.engine, self._manager.pool, self.device,
                          self._budget_bytes, self._manager.tier)

    def _other_size(self, first: Any) -> tuple[Any, MovingStep | None] | None:
        """A fast step whose first saved tensor is not its plan's (another sequence length):
        the structure's plan for that size, when one ran clean and may go fast, takes over;
        else the plan with the smallest first saved tensor that covers the step's (a shorter
        length: ``covers``), whose saved tensors the rest of the step must fit in."""
        fast = self._fast
        if fast is None or threading.get_ident() != fast.thread:
            return None
        found = self._covering_plan(self._structures[fast.plan.signature], first)
        if found is None:
            fast.missed = first
            return None
        if found is not fast.plan:
            fast.plan, fast.moving = found, self._moving_for(found)
            self._running = found
        return found.packs, fast.moving

    def _covering_plan(self, structure: Structure, first: Fingerprint) -> Plan | None:
        """The structure's plan that may go fast for a step whose first saved tensor is
        ``first``: the one of that size, else the smallest whose saved tensors cover it."""
        plans = [p for p in structure.sizes.values() if p.packs]
        found = next((p for p in plans if p.packs[0] == first and self._fast_ok(p)), None)
        if found is None:
            covering = [p for p in plans if covers(p.packs[0], first) and self._fast_ok(p)]
            if covering:
                found = min(covering, key=lambda p: math.prod(p.packs[0][0]))
        return found

    def _can_decide(self) -> bool:
        """Whether steps may pick their path at their first saved tensor: nothing is on that the
        fast path cannot follow (``verify``'s checksums, rebuilt calls)."""
        return self.config.fast_replay and not self.config.verify and self._recompute is None

    def _decides(self, plan: Plan | None) -> bool:
        """Whether a step starts checked and picks its path at its first saved tensor: its
        structure's lengths vary, and it records no module calls (``_can_decide``)."""
        return (plan is not None and self._structures[plan.signature].varies and not self._want_spans
                and self._can_decide())

    def _hand_off(self, first: Fingerprint) -> SavedTensorGuard | None:
        """A deciding step's first saved tensor (``_decides``), from the checked replay's guard:
        where a plan covers it and the replay has moved nothing yet, the checked start is
        undone and the fast path runs the step from here; else the step stays checked, and
        teaches its plan this length."""
        executor, running = self._executor, self._running
        if (not isinstance(executor, ReplayExecutor) or running is None or executor.online
                or executor.diverged_at is not None or torch._C._current_graph_task_id() != -1):
            return None
        m = self._manager
        if m.entries or m.bytes_d2h or m.bytes_h2d:  # (none the plan moved before its first saved tensor)
            return None
        plan = self._covering_plan(self._structures[running.signature], first)
        if plan is None:
            return None
        checked_ops = executor.index
        self._undo_enter(executor, entered=True)
        self._recompute_enter(None)
        self._running = plan
        self._begin_tier(plan)
        self._start_fast(plan)
        assert self._fast is not None
        self._fast.checked_ops = checked_ops
        return self._fast.guard

    def _exit_fast(self, fast: FastStep, clean: bool) -> None:
        """A fast step that needed no fallback: its report, and what the session learns."""
        moving = fast.moving
        if moving is not None:
            self._manager.engine.end_step()
        if not clean:
            return
        plan = fast.plan
        structure = self._structures[plan.signature]
        report = StepReport(phase="replay", op_count=plan.program.num_ops,
                            peak_resident_bytes=plan.program.planned_peak, budget_bytes=self._budget_bytes,
                            step_ms=(time.perf_counter() - fast.t0) * 1e3,
                            predicted_step_ms=plan.predicted_ms, replay_path="fast",
                            peak_host_bytes=self._manager.peak_host_bytes,
                            bytes_to_disk=self._manager.bytes_to_disk,
                            bytes_from_disk=self._manager.bytes_from_disk,
                            checked_prefix_ops=fast.checked_ops)
        report.disk_write_ms, report.disk_read_ms = self._manager.disk_ms()
        held: frozenset[int] = frozenset()
        if moving is not None:
            report.bytes_d2h, report.bytes_h2d = moving.bytes_d2h, moving.bytes_h2d
            report.demand_faults = moving.demand_faults
            report.exposed_wait_ms = self._manager.engine.exposed_wait_ms()
            # Python held bytes the plan released: what the plan had, plus those
            report.peak_resident_bytes = max(report.peak_resident_bytes, moving.worst)
            report.held_past_release_bytes = moving.held_past_release
            if moving.held_past_release:
                held = moving.held_sids
        complete = fast.guard.complete()
        if complete:
            structure.size_misses = 0
        else:  # it ended early or departed in backward: peak unmeasured
            report.departed_at_saved = (fast.guard.count if fast.guard.departed_at is None
                                        else fast.guard.departed_at)
        plan.annotate(report)
        self._structures.move_to_end(plan.signature)
        structure.last = plan
        self._learn(plan.signature)
        self._current = plan
        if not complete or held:
            self._off_plan(plan, held if complete else frozenset())
        self._recompute_report(report)
        self.phase = "replay"
        self.last_report = report

    def _after_fallback(self, executor: FallbackExecutor, report: StepReport) -> None:
        """A fast step that departed: its plan is checked again next time (or traced there)."""
        plan = self._running
        assert plan is not None
        structure = self._structures[plan.signature]
        report.held_past_release_bytes = executor.held_bytes
        moves = executor.fast_moves
        if moves is not None:  # what the step moved before it left its plan, and its page-ins after
            report.bytes_d2h += moves.bytes_d2h
            report.bytes_h2d += moves.bytes_h2d
            report.demand_faults += moves.demand_faults
        if executor.departed_at == 0 and not executor.held_sids:
            # at its first saved tensor, nothing moved yet: a size no learned plan covers
            # (else the guard took it), longer than any learned; checked steps teach it. A
            # structure that keeps missing with nothing learned between stays checked: the
            # checked replay follows any length, the fast path only ones a plan covers. Where
            # the next steps can pick their path at their first saved tensor, they do that instead
            if self._can_decide():
                structure.varies, structure.to_learn = True, 0
            else:
                self._learn_after_miss(structure, executor.missed)
                structure.size_misses += 1
                if structure.size_misses > MAX_SIZE_MISSES:
                    structure.departures = FAST_DEPARTURES
        else:
            self._off_plan(plan, executor.held_sids)
        self._recompute_report(report)  # its calls were rebuilt whichever path ran them
        self.phase = "warmup" if self._choose() is None else "replay"
        self.last_report = report

    @staticmethod
    def _learn_after_miss(structure: Structure, missed: Fingerprint | None) -> None:
        """Checked steps after a fallback no plan covered, unless the last ones taught nothing:
        they are checked whatever their length, and teach the missed one only if a step that
        long comes among them (random lengths: the longest few rarely do, and each fallback
        made every length checked for ``LEARN_STEPS`` steps). After learning steps that did
        not cover their fallback's length, the next 1, 2, 4, ... such fallbacks pass with the
        lengths plans cover staying fast; a repeating length is still learned, a few
        fallbacks later at most."""
        last = structure.missed
        if last is not None and not structure.to_learn:  # the learning steps it began are over
            taught = any(p.packs and covers(p.packs[0], last) for p in structure.sizes.values())
            structure.learn_backoff = 0 if taught else max(1, LEARN_BACKOFF * structure.learn_backoff)
            structure.learn_skips, structure.missed = structure.learn_backoff, None
        if structure.learn_skips:
            structure.learn_skips -= 1
        else:
            structure.to_learn, structure.missed = LEARN_STEPS, missed

    def _off_plan(self, plan: Plan, held: frozenset[int]) -> None:
        """A fast step left its plan: checked again next time; where it was storages Python
        held past their release (``held``), planned again with them kept, else a departure."""
        packs, plan.packs = plan.packs, None
        refined = self._refine(plan, held) if held else None
        if refined is not None:
            # the same saved tensors, the new plan's moves on the same events: fast next step
            if packs is not None and plan.events is not None:
                scheduled = self._scheduled(refined, plan.events)
                if scheduled is not None:
                    scheduled.packs = packs
            logger.info("fast replay: storages %s the plan released were still held by Python; planned "
                        "again with them kept", sorted(held))
            return
        if held:
            logger.info("fast replay: storages %s the plan released were still held by Python; the plan "
                        "is checked again", sorted(held))
        self._structures[plan.signature].departures += 1

    def _learn_packs(self, executor: ExecutorBase, recorder: SavedTensorGuard) -> None:
        """A checked replay that followed its plan to the end: its saved tensors are what a
        fast step of that plan must save. Not one where a copy found no host room (the host
        pool's cap, or a host budget whose room copies in flight held): a fast step of that plan
        would find none either and hand the step to the dispatch mode, a fallback, after the
        copies it made; the plan stays checked until a checked step finds room for all."""
        running = self._running
        if not (isinstance(executor, ReplayExecutor) and running is not None and executor.diverged_at is None
                and recorder.count and not recorder.lifted and not self._manager.cap_hits):
            return
        structure = self._structures.get(running.signature)
        # the plan the step ended on (replay switches to the plan of the step's size), if the
        # step was of that plan's size (a step of a size with no plan yet follows another's)
        plan = None if structure is None else next(
            (p for p in structure.sizes.values() if p.program is executor.program), None)
        nbytes = executor.table.nbytes
        if plan is None or size_bucket(nbytes[0] if nbytes and plan.packed.size_of(0, -1) >= 0 else 0) \
                != plan.program.bucket:
            return
        if structure.to_learn:
            structure.to_learn = 0 if plan.packs is None else structure.to_learn - 1
        if plan.fast_floor is None and recorder.log is not None:
            self._fast_floor(plan, recorder.log)
        packs = tuple(recorder.fingerprints)
        if plan.packs is not None and covers_all(plan.packs, packs):
            return  # what the plan learned covers this step's (and its schedule stands)
        if plan.moves:
            if recorder.log is None:
                return
            scheduled = self._scheduled(plan, recorder.log.frozen())
            if scheduled is None:
                return
            plan = scheduled
        structure.size_misses = 0  # lengths up to this step's go fast now: not a miss streak
        plan.packs = packs

    def _fast_floor(self, plan: Plan, events: EventLog) -> None:
        """The plan's floor with every storage the fast path cannot move pinned, and a word
        (once a session) where the budget lies between the two floors."""
        trace, _, arrays = self._fast_trace(plan, plan.packed.pinned_sids | _unmovable(plan, events), events)
        with arrays_given(trace, arrays):
            plan.fast_floor = budget_floor(trace)
        general = plan.floor
        if (general.floor_bytes <= self._budget_bytes < plan.fast_floor.floor_bytes
                and not self._said_below_fast_floor):
            logger.warning("%s", plan.fast_floor.below_fast_floor_message(self._budget_bytes, general))
            self._said_below_fast_floor = True

    @staticmethod
    def _fast_trace(plan: Plan, pinned: frozenset[int], events: EventLog | None
                    ) -> tuple[ActivationTrace, PackedTrace, TraceArrays]:
        """``plan``'s trace with ``pinned`` kept on the device, packed, and its arrays with
        the spans Python held saved storages in forward as reads (``EventLog.held_reads``):
        what a plan the fast path can run is planned on; it moves storages across the step's
        turn from forward to backward only (``TraceArrays.gap_boundary``), as the fast path
        does, so one re-plan suffices where pinning each refused storage in turn took many
        (a step with calls rebuilt in backward: five, and still one refused)."""
        trace = replace(plan.trace, pinned_sids=pinned)
        packed = PackedTrace(trace, plan.packed)
        arrays = packed_trace_arrays(trace, packed)
        if events is not None:
            arrays = with_reads(arrays, *events.held_reads(frozenset(trace.storage_sizes) - pinned))
            arrays = replace(arrays, gap_boundary=events.backward_op())
        return trace, packed, arrays

    def _scheduled(self, plan: Plan, events: EventLog) -> Plan | None:
        """``plan``'s moves placed on a checked replay's saved-tensor events, or, where it moves
        storages the fast path cannot, the plan made again with them kept (the events are the
        model's, not the plan's: a re-plan's moves go on the same ones, no checked step each)."""
        schedule = MoveSchedule.build(events, plan.program, self._budget_bytes)
        while isinstance(schedule, Refusal):
            plan.fast_refusal = schedule.why
            keep = schedule.sids
            if not schedule.advisory:  # all the fast path can never move at once: one re-plan, not many
                keep = keep | _unmovable(plan, events)
            refined = self._refine(plan, keep, final=not schedule.advisory, events=events)
            if refined is None and schedule.advisory:
                # keeping what Python held does not fit: run fast anyway, as before this look
                # ahead; a step that holds them that way falls back to the dispatch mode
                schedule = MoveSchedule.build(events, plan.program)
                continue
            if refined is None:
                logger.debug("this plan keeps the checked replay: %s", schedule.why)
                return None
            plan = refined
            schedule = MoveSchedule.build(events, plan.program, self._budget_bytes) if plan.moves else None
        plan.move_schedule, plan.events = schedule, events
        return plan

    def _refine(self, plan: Plan, keep: frozenset[int], final: bool = True,
                events: EventLog | None = None) -> Plan | None:
        """Plan the same trace again with ``keep`` on the device, for a plan the fast path can
        run; the new plan (returned) replaces ``plan`` when it keeps the budget. A ``final``
        attempt that does not fit ends the re-plans of ``plan``."""
        structure = self._structures.get(plan.signature)
        if (structure is None or plan.refinements >= MAX_REFINEMENTS
                or plan.program.planned_peak > self._budget_bytes):
            return None
        trace, packed, arrays = self._fast_trace(plan, plan.packed.pinned_sids | keep, events or plan.events)
        new = self._plan(plan.signature, trace, structure.keys, plan.program, packed, arrays, quiet=True)
        if new.program.planned_peak > self._budget_bytes or new.floor.floor_bytes > self._budget_bytes:
            logger.debug("keeping %d storage(s) on the device for the fast path would exceed the budget "
                         "(%s)", len(keep), plan.fast_refusal)
            if final:
                plan.refinements = MAX_REFINEMENTS
            return None
        new.refinements = plan.refinements + 1
        new.kept_for_fast = plan.kept_for_fast | keep
        new.floor = plan.floor  # the user's floor: the pins are the fast path's, not the step's
        new.fast_floor = plan.fast_floor
        for bucket, p in list(structure.sizes.items()):
            if p is plan:
                structure.sizes[bucket] = new
        if structure.last is plan:
            structure.last = new
        if self._current is plan:
            self._current = new
        return new

    def _event_log(self, executor: ExecutorBase) -> EventLog | None:
        """For a checked replay of a plan that moves bytes: where its saved-tensor events fall."""
        running = self._running
        if not (isinstance(executor, ReplayExecutor) and running is not None and self.config.fast_replay):
            return None
        structure = self._structures.get(running.signature)
        # a plan that learned its saved tensors may learn a longer step's (``_learn_packs``)
        if structure is None:
            return None
        # the step may end on any size's plan (replay switches)
        moving = any(p.moves and p.program.planned_peak <= self._budget_bytes
                     and (p.fast_refusal is None or p.refinements < MAX_REFINEMENTS)
                     for p in structure.sizes.values())
        if not moving and all(p.fast_floor is not None for p in structure.sizes.values()):
            return None  # nothing to learn: they never run fast, or move nothing and know their floors
        # (the spans Python holds saved storages count in the fast-path floor: watched either way)
        table = executor.table
        sid_of, nbytes = table.sid_of, table.nbytes
        engine = self._manager.engine

        def settle() -> None:
            engine.synchronize()
            engine.poll()

        return EventLog(lambda: executor.index, lambda st: sid_of.get(id(st), -1), nbytes.__getitem__, settle,
                        watch=True)


def _unmovable(plan: Plan, events: EventLog) -> frozenset[int]:
    """The storages of ``plan``'s trace the fast path can never move (``EventLog.unmovable``)."""
    return events.unmovable(frozenset(plan.packed.storage_sizes()))
