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

from typing import Any

import torch

from hyperpar.offload.capture.checked.replay_program import (
    AFTER_DEATH,
    BINDS,
    HAS_MOVED,
    HAS_PRE,
    HAS_WRITES,
    NESTED_INPUTS,
    NOT_LEAN,
    SCHEDULED,
    ReplayProgram,
)
from hyperpar.offload.capture.checked.replay_regions import ReplayRegions
from hyperpar.offload.capture.checked.replay_state import SLACK_BYTES, logger
from hyperpar.offload.capture.mode.executor_base import internal
from hyperpar.offload.capture.ops.errors import OffloadDivergenceError
from hyperpar.offload.capture.ops.op_args import output_leaves, tensor_inputs
from hyperpar.offload.capture.ops.op_identity import op_name
from hyperpar.offload.capture.tracing.warmup import recorded_trace
from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.ir.guide import NOT_ACTIVATION
from hyperpar.offload.ir.report import StepReport

Tensor = torch.Tensor


class ReplayExecutor(ReplayRegions):
    """Runs a step along its plan; the layers below hold its other paths (see ``replay_state``)."""

    phase = "replay"

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

    def describe_op(self) -> str:
        if self.online:
            return super().describe_op()
        i = self.index - 1
        name = self.program.names[i] if 0 <= i < self._n else "-"
        return f"at op {i} ({name})"

    def read_behind_dispatcher(self, storage: torch.UntypedStorage) -> None:
        sid = self.table.lookup(storage)
        if sid is None:
            return
        if not self.online and sid in self.program.moved and sid not in self.table.pinned:
            self._diverge(self.index, "-", f"storage {sid} was read behind the dispatcher")
        super().read_behind_dispatcher(storage)

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

    def build_trace(self, d2h_gbps: float, h2d_gbps: float) -> ActivationTrace | None:
        """The step as it ran when it diverged (None when it followed the plan)."""
        if not self.recording:
            return None
        return recorded_trace(self, d2h_gbps, h2d_gbps, first_timed=self._first_online)
