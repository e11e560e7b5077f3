"""Replay: run the planned actions around each op, checking the step is the traced one.

Before each op replay checks that it is the planned op and that every tensor input is the
very storage the plan expects (the same activation, or no activation at all); after it,
that the outputs have the planned shapes and dtypes and that the new storages are new. Any
difference is a divergence: from that op on the step takes the online path (warmup's
budget-keeping algorithm, see ``executor_base``) and records itself, so it is finished
within the budget and becomes a trace the session learns. With ``on_divergence="raise"``
an ``OffloadDivergenceError`` names the op instead.

Only a storage the schedule moves can be off the device while replay follows the plan, so
only those are paged in, waited on and marked stale; a write the plan did not predict can
only come from a divergence (caught before the op runs) or from inside an opaque region,
whose accesses mark host copies stale as they happen.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from hyperpar.offload.capture.errors import OffloadDivergenceError
from hyperpar.offload.capture.executor_base import (
    COLLECTIVE,
    ExecutorBase,
    OpState,
    internal,
    op_kind,
    op_name,
)
from hyperpar.offload.capture.op_args import output_leaves, tensor_inputs, written_tensors
from hyperpar.offload.capture.replay_program import (
    AFTER_DEATH,
    BINDS,
    D2H,
    H2D,
    HAS_MOVED,
    HAS_POST,
    HAS_PRE,
    HAS_WRITES,
    NESTED_INPUTS,
    NOT_LEAN,
    RELEASE,
    RELEASE_FINAL,
    SCHEDULED,
    ReplayProgram,
    size_bucket,
)
from hyperpar.offload.capture.warmup import recorded_trace
from hyperpar.offload.ir import AccessKind, ActivationTrace
from hyperpar.offload.ir.guide import NO_STORAGE, NOT_ACTIVATION
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.runtime import ResidencyManager, StorageEntry

logger = logging.getLogger(__name__)
Tensor = torch.Tensor
READ, WRITE = AccessKind.READ, AccessKind.WRITE
# Replay starts evicting on its own (see ``_relieve``) when it holds more than the budget,
# or than the plan's own peak when the budget cannot be met, by more than this slack:
# copies in flight hold dead storages a little longer than the trace saw.
SLACK_BYTES = 64 << 10
# A step whose first activation is this much larger than its plan's (beyond the ~19 % of a
# size class: no plan of its size is near) skips the plan's prefetches, which bring back
# storages that many times larger ahead of their use: inputs come back when an op needs
# them (HF GPT-2 at 2.3x its plan's tokens, infeasible budget: peak 8.09 MiB against a
# floor of 6.07 with the prefetches, 6.07 without).
ON_DEMAND_GROWTH = 1.25


def _top(budget: int, program: ReplayProgram) -> int:
    """What replay holds to: the budget, or the floor at the plan's sizes where the budget is
    below it (instant copies: whatever peak the timed plan predicted from measured times,
    copies slower than it assumed are waited for, not paid in memory); without a floor, the
    plan's own peak."""
    if program.floor_bytes:
        return max(budget, program.floor_bytes)
    return max(budget, program.planned_peak)


def _limit(top: int) -> int:
    return top + max(SLACK_BYTES, top // 50)


def _describe(leaves: list[Any] | tuple[Any, ...]) -> str:
    parts = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            parts.append(f"{tuple(leaf.shape)}:{str(leaf.dtype).removeprefix('torch.')}")
        elif isinstance(leaf, tuple) and len(leaf) == 2 and isinstance(leaf[1], torch.dtype):
            parts.append(f"{leaf[0]}-d:{str(leaf[1]).removeprefix('torch.')}")
        else:
            parts.append("-")
    return "[" + ", ".join(parts) + "]"


def _has_tensors(kwargs: dict[str, Any]) -> bool:
    for v in kwargs.values():
        if isinstance(v, Tensor) or (type(v) in (list, tuple) and v and not isinstance(v[0], (int, float))):
            return True
    return False


class _Region:
    """A plan-following opaque region: the sids its inner ops touched."""

    __slots__ = ("in_ids", "index", "kinds")

    def __init__(self, index: int, kinds: dict[int, AccessKind], in_ids: set[int]) -> None:
        self.index, self.kinds, self.in_ids = index, kinds, in_ids


class ReplayExecutor(ExecutorBase):
    phase = "replay"

    def __init__(self, manager: ResidencyManager, device: torch.device, budget_bytes: int,
                 program: ReplayProgram, on_divergence: str,
                 alternatives: tuple[ReplayProgram, ...] = ()) -> None:
        super().__init__(manager, device, budget_bytes)
        self.program = program
        self.alternatives = alternatives  # other known plans: a step may turn out to be one
        self.table.reserve(program.num_sids)
        self.table.pinned.update(program.pinned)
        self.online = False  # after a divergence: every op takes the online path
        self.diverged_at: int | None = None
        self.divergence: str | None = None  # why, in words
        self._n = program.num_ops
        self._raise = on_divergence == "raise"
        self._opaque_marks: list[int] = []
        self._replay_regions: list[_Region] = []
        self._careful = False  # _growth, relieved or _grew: ops make room first (``_make_room``)
        # an op made more than planned (``_outgrown``), or the plan's peak is above what the
        # step holds to (``_hold_to``)
        self._grew = False
        self._top = self._limit = 0
        self._hold_to(_top(budget_bytes, program))
        self.relieved = False  # evicted beyond the plan: every op pages in and marks writes
        self.first_size = -1  # bytes of the step's first activation (picks the size's plan)
        self._growth = 0.0  # when > 1: this step's sizes over the plan's; room is made before ops
        self._on_demand = False  # skip the plan's prefetches: inputs come back when an op needs them
        # bytes an op makes at the plan's sizes -> the most bytes made / those, in careful mode
        self._made_ratio: dict[int, float] = {}
        self._most_growth = 0.0  # the largest of those ratios
        self._keys = (*program.keys, None)  # op ``num_ops`` is no op of the plan
        self._sid_get = self.table.sid_of.get
        self._slow = True  # every op takes ``_run_op`` (see ``_settle``)

    def _settle(self) -> None:
        """Whether ops may take the lean path: once the step's size is known (its first
        activation), while it follows the plan at the plan's sizes, untimed."""
        self._slow = self.online or self._careful or self.first_size < 0 or self.timer is not None

    # --- ops (the hot path) ---------------------------------------------------------
    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The lean path: an op the plan moves nothing around, whose inputs are positional and
        whose output is one tensor making at most one new storage (most ops), checked with one
        dict lookup per input and a dtype and a rank column for the output. Anything else, or
        any doubt, takes ``_run_op`` (or ``_outputs`` once the op ran), which checks again."""
        i = self.index
        p = self.program
        if self._slow or func is not self._keys[i] or (flags := p.flags[i]) & NOT_LEAN:
            return self._run_op(func, args, kwargs)
        k = p.in_start[i]  # ``_positional_inputs_match``, inline: the call would cost as much
        in_sid, sid_get = p.in_sid, self._sid_get
        try:
            for a in args:
                if isinstance(a, Tensor):
                    if sid_get(id(a.untyped_storage()), NOT_ACTIVATION) != in_sid[k]:
                        k = -1
                        break
                    k += 1
        except (IndexError, RuntimeError, NotImplementedError):
            k = -1
        if k != p.in_start[i + 1]:
            return self._run_op(func, args, kwargs)
        self.index = i + 1
        m = self.manager
        if m.pending_free:
            self._reap(i)
        out = p.calls[i](*args, **kwargs)
        if type(out) is not Tensor or out.dtype is not p.out_dtype[i] or out.dim() != p.out_ndim[i]:
            return self._outputs(i, flags, func, args, kwargs, out)
        if flags & BINDS:
            try:
                st = out.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return self._outputs(i, flags, func, args, kwargs, out)
            table = self.table
            if id(st) in table.sid_of:  # not a new storage: settled there
                return self._outputs(i, flags, func, args, kwargs, out)
            sid = p.bind_sid[p.bind_start[i]]
            table.bind(sid, st, i)
            if sid in p.moved:
                m.bind(sid, st, i)
            if table.nbytes[sid] > p.made[i]:  # larger than planned: later ops make room first
                self._outgrown(i, table.nbytes[sid])
            resident = table.live_bytes - m.away_bytes + m.pending_bytes  # ``_note_resident``, inline
            if resident > self.peak_bytes:
                self.peak_bytes, self.peak_op = resident, i
                if resident > self._limit:
                    self._relieve(i)
                elif resident > p.planned_resident[i] + SLACK_BYTES:
                    self._off_plan()
        return out

    def _run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.online:
            return self.online_op(func, args, kwargs)
        i = self.index
        p = self.program
        if i >= self._n or func is not p.keys[i]:
            if self._switch(i, func, None, None, None):
                return self.run_op(func, args, kwargs)
            self._diverge(i, op_name(func), "another op")
            return self.online_op(func, args, kwargs)
        # Each tensor input must be the very storage the plan expects. When the schema allows
        # tensors only as positional arguments, one pass over ``args`` sees them all; anything
        # unexpected there (or a list or keyword tensor) is settled by the general check.
        flags = p.flags[i]
        ok = not flags & NESTED_INPUTS and self._positional_inputs_match(p, i, args)
        if not ok and not self._inputs_match(tensor_inputs(args, kwargs), p.inputs(i)):  # type: ignore[arg-type]
            if self._switch(i, func, tensor_inputs(args, kwargs), None, None):
                return self.run_op(func, args, kwargs)
            self._diverge(i, op_name(func), "its inputs are other storages than the plan's")
            return self.online_op(func, args, kwargs)
        self.index = i + 1
        m = self.manager
        if flags & SCHEDULED:  # the plan moves storages around this op
            if flags & HAS_PRE:
                self._act(p, 2 * i)
            if m.pending_free or flags & AFTER_DEATH:
                self._reap(i)
            if self._careful:  # room first, for its outputs and for inputs coming back
                self._make_room(i, p.inputs(i) or ())
            if flags & HAS_MOVED:
                self._bring_moved(p.in_moved(i), p.writes(i) if flags & HAS_WRITES else None)
        elif m.pending_free or flags & AFTER_DEATH:
            self._reap(i)
        if self._careful:  # a step larger than its plan, or evicting beyond it
            if not flags & SCHEDULED:
                self._make_room(i, p.inputs(i) or ())
            if self.relieved:
                self._bring_any(func, tensor_inputs(args, kwargs), args, kwargs)
        timer = self.timer
        if timer is None:
            out = func(*args, **kwargs)
        else:
            begin = timer.mark()
            out = func(*args, **kwargs)
            self.op_marks.append((p.names[i], begin, timer.mark()))
        return self._outputs(i, flags, func, args, kwargs, out)

    def _hold_to(self, top: int) -> None:
        """The bytes this step holds to (``_top``), and the limit above which it evicts beyond
        its plan (that plus the slack). A plan whose own peak is above it (a timed plan that
        expected slow copies to cost memory) is followed carefully: room before every op."""
        self._top, self._limit = top, _limit(top)
        if self.program.planned_peak > self._limit:
            self._grew = self._careful = True

    def _reap(self, i: int) -> None:
        """Free the device bytes finished copies let go of; where releases still in flight
        leave no room for op ``i``'s outputs within the budget, wait for the oldest of them."""
        m = self.manager
        m.reap()
        if m.pending_bytes:
            over = self.resident_bytes() + self.program.made[i] - self._top
            if over > 0:
                m.free_pending_until(over)

    def _positional_inputs_match(self, p: ReplayProgram, i: int, args: tuple[Any, ...]) -> bool:
        """Whether each positional tensor argument is the storage the plan expects: one lookup
        per argument, as ``sid_of`` holds live storages only. A mismatch here may still be the
        plan's (a storage bound to two sids): ``_inputs_match`` settles it."""
        k = p.in_start[i]
        in_sid, sid_get = p.in_sid, self._sid_get
        try:
            for a in args:
                if isinstance(a, Tensor):
                    if sid_get(id(a.untyped_storage()), NOT_ACTIVATION) != in_sid[k]:
                        return False
                    k += 1
        except (IndexError, RuntimeError, NotImplementedError):  # more inputs, a storage-less tensor, ...
            return False
        return k == p.in_start[i + 1]

    def _outputs(self, i: int, flags: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> Any:
        """After op ``i`` ran: check its outputs, bind its new storages, follow its post list."""
        p, m = self.program, self.manager
        table = self.table
        sid_of = table.sid_of
        meta = p.meta[i]
        if type(out) is Tensor:
            leaves = None
            if len(meta) != 1 or (m0 := meta[0]) is None or out.dtype is not m0[1] or out.dim() != m0[0]:
                if not self._switch(i, func, tensor_inputs(args, kwargs), out, None):
                    self._diverge_after(i, func, args, kwargs, [out], "other output dtypes or ranks")
                    return out
                p = self.program
                flags = p.flags[i]
        else:
            leaves = output_leaves(out)
            if not self._meta_matches(meta, leaves) and not self._switch(
                    i, func, tensor_inputs(args, kwargs), None, leaves):
                self._diverge_after(i, func, args, kwargs, leaves, "other output dtypes or ranks")
                return out
            p = self.program
            flags = p.flags[i]
        if flags & BINDS:
            lo = p.bind_start[i]
            if (leaves is None and not self.relieved and self.first_size >= 0
                    and p.bind_start[i + 1] == lo + 1):
                # the common case: one new storage, nothing else to do for it
                sid = p.bind_sid[lo]
                try:
                    st = out.untyped_storage()
                    key = id(st)
                except (RuntimeError, NotImplementedError):
                    st = None
                if st is None or key in sid_of:
                    self._diverge_after(i, func, args, kwargs, [out], "an output is not a new storage")
                    return out
                table.bind(sid, st, i)
                if sid in p.moved:
                    m.bind(sid, st, i)
            elif not self._bind(i, p.binds(i), out, leaves):  # type: ignore[arg-type]
                self._diverge_after(i, func, args, kwargs, leaves or [out], "an output is not a new storage")
                return out
            p = self.program  # ``_bind`` may have picked the plan of the step's size
            if p.made[i]:  # how much larger than planned this op's outputs came out
                nbytes = table.nbytes
                made = sum(nbytes[sid] for sid in p.bind_sid[p.bind_start[i]:p.bind_start[i + 1]])
                if self._careful:
                    self._note_made(p.made[i], made)
                elif made > p.made[i]:
                    self._outgrown(i, made)
        if flags & SCHEDULED:
            self._after(i)
        elif flags & BINDS and self._note_resident(i):  # else nothing can have grown what the device holds
            self._relieve(i)
        return out

    def _outgrown(self, i: int, made: int) -> None:
        """Op ``i`` made more bytes than its plan says (a plan of another size, whose first
        activation was not smaller, can still have smaller storages elsewhere: another batch
        size with another length): from here on every op makes room before it runs."""
        planned = self.program.made[i]
        if planned:  # (an empty storage at the plan's sizes says nothing of growth)
            self._note_made(planned, made)
        self._off_plan()

    def _note_made(self, planned: int, made: int) -> None:
        ratio = made / planned
        ratios = self._made_ratio
        if ratio > ratios.get(planned, 0.0):
            ratios[planned] = ratio
        if ratio > self._most_growth:
            self._most_growth = ratio

    def _note_resident(self, i: int) -> bool:
        """Update the step's peak; whether it holds more than its limit."""
        resident = self.table.live_bytes - self.manager.away_bytes + self.manager.pending_bytes
        if resident > self.peak_bytes:
            self.peak_bytes, self.peak_op = resident, i
            if not self._careful and resident > self.program.planned_resident[i] + SLACK_BYTES:
                self._off_plan()
        return resident > self._limit

    def _off_plan(self) -> None:
        """The step holds more than its plan says at this op (a plan of another size: another
        batch size with another length can have larger storages than a larger plan's): from
        here on every op makes room before it runs."""
        if not self._careful:
            self._grew = self._careful = True
            self._settle()

    def _make_room(self, i: int, inputs: Any) -> None:
        """Before op ``i`` of a step larger than its plan (or relieved): room for what it is
        about to make and for its inputs that must come back, keeping the inputs."""
        p, m = self.program, self.manager
        planned = p.made[i]
        room = 0
        if planned:
            # An op that makes as many bytes at the plan's sizes as one already run (the same
            # shape, another layer's or the backward's) grows at most as that one did
            # (attention scores with the square of the length); else as the first activation
            # did, or as the most any op of the step grew (a first activation that does not
            # grow, FSDP2's, says nothing of a larger batch), or as planned.
            room = int(planned * (self._made_ratio.get(planned) or max(self._growth, self._most_growth, 1.0)))
        if m.evicted:  # inputs off the device come back below
            entries = m.entries
            room += sum(e.nbytes for sid in inputs if (e := entries.get(sid)) is not None and not e.resident)
        if room and self.resident_bytes() + room > self._limit:
            self._relieve(i, set(inputs), room)

    def _inputs_match(self, ins: list[Tensor], expected: Sequence[int]) -> bool:
        if len(ins) != len(expected):
            return False
        ids, sid_of = self.table.ids, self.table.sid_of
        for t, sid in zip(ins, expected, strict=True):
            try:
                key = id(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                if sid != NO_STORAGE:
                    return False
                continue
            if sid >= 0:
                if ids[sid] != key:
                    return False
            elif sid == NOT_ACTIVATION:
                if key in sid_of:
                    return False
            else:
                return False
        return True

    def _evictable_again(self, entries: Sequence[StorageEntry]) -> None:
        """Storages back on the device after evicting beyond the plan may be evicted again
        (the oldest first, as any other): without this, what came back stayed for the rest of
        the step and the budget could not be kept."""
        if self.relieved:
            pinned, producer, heap = self.table.pinned, self.table.producer, self._heap
            for entry in entries:
                if entry.sid not in pinned:
                    heapq.heappush(heap, (producer[entry.sid], -entry.nbytes, entry.sid))

    def _bring_moved(self, moved: Sequence[int], writes: Sequence[int] | None) -> None:
        m = self.manager
        entries, inflight = m.entries, m.inflight
        for sid in moved:
            entry = entries.get(sid)
            if entry is None:
                continue
            if not entry.resident:
                m.copy_h2d(entry, demand=True)
                self._evictable_again((entry,))
            elif inflight and inflight.get(entry.key) is entry:  # its H2D, not waited on yet
                m.wait_h2d(entry)
        if writes is not None:
            for sid in writes:  # its copy out must have read the old bytes
                entry = entries.get(sid)
                if entry is not None and entry.d2h_event is not None:
                    m.wait_d2h(entry)

    def _bind(self, i: int, binds: tuple[tuple[int, int], ...], out: Any,
              leaves: list[Any] | None) -> bool:
        table, m = self.table, self.manager
        sid_of = table.sid_of
        for leaf_index, sid in binds:
            leaf = out if leaves is None else leaves[leaf_index]
            try:
                st = leaf.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return False
            if id(st) in sid_of:
                return False
            table.bind(sid, st, i)
            if sid == 0 and self.first_size < 0:
                self._pick_size(table.nbytes[0])
            if sid in self.program.moved:
                m.bind(sid, st, i)
            if self.relieved and sid not in table.pinned:
                heapq.heappush(self._heap, (i, -table.nbytes[sid], sid))
        return True

    def _pick_size(self, nbytes: int) -> None:
        """The step's first activation tells its size: follow the plan made for that size (or
        the nearest larger one, which moves at least enough), if another is known."""
        self.first_size = nbytes
        want, p = size_bucket(nbytes), self.program
        self._note_growth()
        if p.bucket == want:
            return
        same = [alt for alt in self.alternatives
                if alt.structure == p.structure and alt.num_ops == p.num_ops]
        if not same:
            return
        exact = [alt for alt in same if alt.bucket == want]
        larger = sorted((alt for alt in same if alt.bucket > want), key=lambda a: a.bucket)
        pick = exact[0] if exact else larger[0] if larger else None
        if pick is None and p.bucket < want:  # all smaller: the largest of them
            pick = max(same, key=lambda a: a.bucket)
            if pick.bucket <= p.bucket:
                pick = None
        if pick is not None and pick is not p:
            self._adopt(pick)

    def _bring_any(self, func: Any, ins: list[Tensor], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> None:
        """After evicting beyond the plan: any input may be off the device, and a write to any
        storage with a host copy makes that copy stale."""
        m = self.manager
        if m.evicted or m.inflight:
            self._evictable_again(m.page_in_inputs(ins))
        written = written_tensors(func, args, kwargs)
        for t in written:
            try:
                entry = m.lookup(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
            if entry is not None:
                if entry.d2h_event is not None:
                    m.wait_d2h(entry)
                m.mark_written(entry)

    def _after(self, i: int) -> None:
        p, m = self.program, self.manager
        flags = p.flags[i]
        if flags & HAS_WRITES:
            entries = m.entries
            for sid in p.writes(i):
                entry = entries.get(sid)
                if entry is not None:
                    m.mark_written(entry)
        over = self._note_resident(i)
        if flags & HAS_POST:
            self._act(p, 2 * i + 1)
        if over:
            self._relieve(i)

    def _relieve(self, i: int, protected: Any = (), room: int = 0) -> None:
        """Holding more than planned (a larger size than the plan's, a release that could not
        happen): evict the oldest activations the way warmup does, still following the plan.
        Before an op of a step larger than its plan: make ``room`` for what it is about to
        allocate, keeping its inputs (``protected``)."""
        if not self.relieved:
            self.relieved = self._careful = True
            self._settle()
            logger.info("replay holds %d bytes after op %d, over its limit of %d: evicting beyond "
                        "the plan for the rest of the step",
                        self.resident_bytes(), i, self._limit)
            with internal(self):
                self.start_online()
        with internal(self):
            top = self._top
            self.enforce_budget(protected, target=top - room)

    def describe_op(self) -> str:
        if self.online:
            return super().describe_op()
        i = self.index - 1
        name = self.program.names[i] if 0 <= i < self._n else "-"
        return f"at op {i} ({name})"

    @staticmethod
    def _meta_matches(meta: tuple[Any, ...], leaves: list[Any]) -> bool:
        """Dtypes and ranks (not sizes: steps of another length follow the same structure)."""
        if len(meta) != len(leaves):
            return False
        for m, leaf in zip(meta, leaves, strict=True):
            if m is None:
                if isinstance(leaf, Tensor):
                    return False
            elif not isinstance(leaf, Tensor) or leaf.dtype is not m[1] or leaf.dim() != m[0]:
                return False
        return True

    def _act(self, p: ReplayProgram, j: int) -> None:
        """Run the program's action list ``j`` (op i's pre list is 2i, its post list 2i+1)."""
        m = self.manager
        entries = m.entries
        codes, sids = p.act_code, p.act_sid
        paged_in = False
        for k in range(p.act_start[j], p.act_start[j + 1]):
            code = codes[k]
            entry = entries.get(sids[k])
            if entry is None:
                continue
            if code == D2H:
                m.copy_d2h(entry)
            elif code == RELEASE:
                m.release_device(entry)
            elif code == H2D:
                if self._on_demand:  # much larger than the plan: its prefetches would overshoot
                    continue
                if self._careful and self.resident_bytes() + entry.nbytes > self._limit:
                    i = j >> 1  # room first: at other sizes the plan's prefetch may not fit
                    self._relieve(i, {sids[k], *(self.program.inputs(i) or ())}, entry.nbytes)
                m.copy_h2d(entry)
                if self.relieved:
                    self._evictable_again((entry,))
                paged_in = True
            elif code == RELEASE_FINAL:
                m.release_device(entry, final=True)
            else:
                m.release_host(entry)
        if paged_in and j & 1 and self._note_resident(j >> 1):  # a pre list's are counted after its op
            self._relieve(j >> 1)

    # --- opaque regions -------------------------------------------------------------
    def begin_opaque(self, name: str, reads: list[torch.UntypedStorage]) -> Any:
        if self.online:
            return self.online_begin_opaque(name, reads)
        i = self.index
        p = self.program
        if (i >= self._n or p.keys[i] != name) and not self._switch(i, name, None, None, None):
            self._diverge(i, name, "another op")
            return self.online_begin_opaque(name, reads)
        p = self.program
        self.index = i + 1
        flags = p.flags[i]
        if flags & HAS_PRE:
            self._act(p, 2 * i)
        kinds: dict[int, AccessKind] = {}
        table = self.table
        in_ids = set()
        for st in reads:
            in_ids.add(id(st))
            sid = table.lookup(st)
            if sid is not None:
                kinds.setdefault(sid, READ)
        if flags & HAS_MOVED:
            self._bring_moved(p.in_moved(i), p.writes(i) if flags & HAS_WRITES else None)
        self._bring_in(kinds)  # a read the plan did not expect (checked at the end)
        if self._careful:
            self._make_room(i, kinds)
        if self.timer is not None:
            self._opaque_marks.append(self.timer.mark())
        region = _Region(i, kinds, in_ids)
        self._replay_regions.append(region)
        return region

    def after_untraced(self, kinds: dict[int, AccessKind]) -> None:
        if self._replay_regions and not self.regions:
            rk = self._replay_regions[-1].kinds
            for sid, kind in kinds.items():
                if kind is WRITE:
                    rk[sid] = WRITE
                else:
                    rk.setdefault(sid, READ)

    def end_opaque(self, token: Any, outputs: list[Tensor]) -> None:
        if isinstance(token, OpState):
            self.online_end_opaque(token, outputs)
            return
        region: _Region = token
        if self._replay_regions and self._replay_regions[-1] is region:
            self._replay_regions.pop()
        i, p = region.index, self.program
        if self.timer is not None and self._opaque_marks:
            self.op_marks.append((p.names[i], self._opaque_marks.pop(), self.timer.mark()))
        leaves = list(outputs)
        if self.online:  # diverged inside the region: record it as it ran
            self._record_region(region, leaves)
            return
        expected = p.region_accesses.get(i) or {}
        binds = p.binds(i)
        if not self._meta_matches(p.meta[i], leaves):
            why = "other output dtypes or ranks"
        elif binds is not None and not self._bind(i, binds, None, leaves):
            why = "an output is not a new storage"
        elif self._region_accesses(region, leaves, binds) != expected:
            why = "the region touched other storages than the plan's"
        else:
            self._after(i)
            return
        if why.startswith("the region") and self._switch_region(region, leaves):
            self._after(i)
            return
        self._diverge(i, p.names[i], why)
        self._record_region(region, leaves)

    def _switch_region(self, region: _Region, leaves: list[Tensor]) -> bool:
        """A region that did what another known plan's region did at this op (data decides
        what a region touches): carry on with that plan. Its outputs were bound as this plan
        binds them; the other plan must bind them the same way."""
        i, p = region.index, self.program
        binds = p.binds(i)
        if not self._meta_matches(p.meta[i], leaves):
            return False
        actual = self._region_accesses(region, leaves, binds)
        for alt in self.alternatives:
            if (alt is not p and alt.num_ops > i and alt.keys[i] == p.keys[i] and alt.binds(i) == binds
                    and (i == 0 or alt.prefix[i - 1] == p.prefix[i - 1])
                    and (alt.region_accesses.get(i) or {}) == actual):
                self._adopt(alt)
                return True
        return False

    def _region_accesses(self, region: _Region, leaves: list[Tensor],
                         binds: tuple[tuple[int, int], ...] | None) -> dict[int, AccessKind]:
        """What warmup would have recorded for this region (see ``online_end``)."""
        actual = dict(region.kinds)
        if binds is not None:
            for _, sid in binds:
                actual[sid] = WRITE
        table = self.table
        for leaf in leaves:
            try:
                st = leaf.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if id(st) not in region.in_ids:
                sid = table.lookup(st)
                if sid is not None:
                    actual[sid] = WRITE
        return actual

    def _record_region(self, region: _Region, leaves: list[Tensor]) -> None:
        """The region's op, recorded from what it did (the trace's prefix ends before it)."""
        self.ops, self.guides, self.keys = self.ops[:region.index], self.guides[:region.index], \
            self.keys[:region.index]
        self._gaps_ms.append(0.0)
        name = self.program.names[region.index]
        state = OpState(region.index, name, name, dict(region.kinds), region.in_ids, (), False)
        state.t0 = time.perf_counter()
        saved_timer, self.timer = self.timer, None
        try:
            self.online_end(state, leaves)
        finally:
            self.timer = saved_timer

    # --- reads behind the dispatcher -------------------------------------------------
    def read_behind_dispatcher(self, storage: torch.UntypedStorage) -> None:
        sid = self.table.lookup(storage)
        if sid is None:
            return
        if not self.online and sid in self.program.moved and sid not in self.table.pinned:
            self._diverge(self.index, "-", f"storage {sid} was read behind the dispatcher")
        super().read_behind_dispatcher(storage)

    # --- divergence and end of step -------------------------------------------------
    def _diverge(self, i: int, actual: str, why: str) -> None:
        """Leave the plan at op ``i`` (ops before it followed the plan)."""
        p = self.program
        if self.diverged_at is None:
            self.diverged_at = i
            if actual == "-":
                msg = f"replay left the plan at op {i}: {why}"
            elif i >= self._n:
                msg = (f"replay diverged from the trace at op {i}: the trace has only {self._n} ops, "
                       f"got {actual}")
            else:
                msg = (f"replay diverged from the trace at op {i}: expected {p.names[i]} -> "
                       f"{_describe(p.meta[i])}, got {actual} ({why})")
            self.divergence = msg
            if self._raise:
                raise OffloadDivergenceError(msg)
            logger.warning("%s; the rest of the step keeps the budget online and is traced", msg)
        if self.online:
            return
        self.online = self._slow = True
        self.recording = True
        self.index = i
        self.ops, self.guides, self.keys = p.packed.ops(i), p.packed.guides(i), list(p.keys[:i])
        self._first_online = i
        with internal(self):
            self.start_online()

    def _switch(self, i: int, func: Any, ins: list[Tensor] | None, out: Any,
                leaves: list[Any] | None) -> bool:
        """Carry on with another known plan whose ops before ``i`` are the ones this step ran
        and whose op ``i`` is this one (checked on its inputs, and on its outputs when the op
        has run). Storages the old plan moved that the new one leaves alone come back first."""
        if self.online or not self.alternatives:
            return False
        p = self.program
        for alt in self.alternatives:
            if alt is p or alt.num_ops <= i or (alt.keys[i] is not func and alt.keys[i] != func):
                continue
            if i > 0 and (i > p.num_ops or alt.prefix[i - 1] != p.prefix[i - 1]):
                continue
            alt_ins = alt.inputs(i)
            if ins is not None and alt_ins is not None and not self._inputs_match(ins, alt_ins):
                continue
            if leaves is not None and not self._meta_matches(alt.meta[i], leaves):
                continue
            if out is not None and type(out) is Tensor and not self._meta_matches(alt.meta[i], [out]):
                continue
            self._adopt(alt)
            return True
        return False

    def _adopt(self, alt: ReplayProgram) -> None:
        m, table = self.manager, self.table
        with internal(self):
            for entry in list(m.entries.values()):
                if entry.sid not in alt.moved:
                    if not entry.resident or entry.free_pending or entry.h2d_event is not None:
                        m.copy_h2d(entry, demand=True)
                    m.release_host(entry)  # nothing will keep that copy current any more
            table.reserve(alt.num_sids)
            for sid in alt.moved:
                st = table.storage(sid)
                if st is not None and sid not in m.entries:
                    m.bind(sid, st, table.producer[sid])
        table.pinned.update(alt.pinned)
        self.program = alt
        self._n = alt.num_ops
        self._keys = (*alt.keys, None)
        self._hold_to(_top(self.budget_bytes, alt))
        self._note_growth()
        if self.relieved:
            self.start_online()

    def _note_growth(self) -> None:
        planned = self.program.packed.size_of(0)
        if self.first_size >= 0 and self.first_size != planned:
            # The plan's own peak over the budget (where the budget cannot be met at its sizes)
            # says nothing at other sizes: only the budget is a limit here.
            self._hold_to(self.budget_bytes)
        ratio = self.first_size / planned if self.first_size > 0 and planned else 0.0
        self._growth = ratio if ratio > 1.0 else 0.0
        self._on_demand = self._growth > ON_DEMAND_GROWTH
        self._careful = bool(self._growth) or self.relieved or self._grew
        self._settle()

    def _diverge_after(self, i: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       leaves: list[Any], why: str) -> None:
        """The op ran under the plan but its outputs differ: record it as it ran."""
        self._diverge(i, f"{op_name(func)} -> {_describe(leaves)}", why)
        self._gaps_ms.append(0.0)
        state = self.online_begin(func, op_name(func), tensor_inputs(args, kwargs),
                                  written_tensors(func, args, kwargs), op_kind(func) == COLLECTIVE)
        saved_timer, self.timer = self.timer, None
        try:
            self.online_end(state, leaves)
        finally:
            self.timer = saved_timer

    def finish(self, clean: bool, step_ms: float) -> tuple[StepReport, Exception | None]:
        self.closed = True
        self.release_region_graphs()
        with internal(self):
            self.manager.restore_all()
        pending: Exception | None = None
        if clean and not self.online and self.index < self._n:
            self._switch_to_shorter()
        if clean and self.diverged_at is None and self.index < self._n:
            self.diverged_at = self.index
            msg = (f"replay diverged from the trace at op {self.index}: the step ended after {self.index} "
                   f"ops, the trace has {self._n} (next expected {self.program.names[self.index]})")
            self.divergence = msg
            if self._raise:
                pending = OffloadDivergenceError(msg)
            else:
                logger.info("%s; the step is traced as it ran", msg)
            self.recording = True
            packed = self.program.packed
            self.ops, self.guides = packed.ops(self.index), packed.guides(self.index)
            self.keys = list(self.program.keys[:self.index])
            self._first_online = self.index
        return self.report(step_ms, diverged_at=self.diverged_at, replay_path="checked"), pending

    def _switch_to_shorter(self) -> None:
        """The step ended early: it may be a known plan that is a prefix of this one."""
        i, p = self.index, self.program
        for alt in self.alternatives:
            if alt.num_ops == i and (i == 0 or alt.prefix[i - 1] == p.prefix[i - 1]):
                self._adopt(alt)
                return

    def build_trace(self, d2h_gbps: float, h2d_gbps: float) -> ActivationTrace | None:
        """The step as it ran when it diverged (None when it followed the plan)."""
        if not self.recording:
            return None
        return recorded_trace(self, d2h_gbps, h2d_gbps, first_timed=self._first_online)
