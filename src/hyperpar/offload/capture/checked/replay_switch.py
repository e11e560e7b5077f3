"""Replay leaving its plan: another known plan the step turns out to be, or the online path.

A step that differs from its plan first tries the other known plans of its structure (a
plan of its size, one whose ops so far are the ones it ran); failing that it *diverges*:
from that op on it takes the online path (warmup's budget keeping, see ``executor_base``)
and records itself, so it ends within the budget and becomes a trace the session learns.
With ``on_divergence="raise"`` an ``OffloadDivergenceError`` names the op instead.
"""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.offload.capture.checked.replay_growth import ReplayGrowth
from hyperpar.offload.capture.checked.replay_program import ReplayProgram, size_bucket
from hyperpar.offload.capture.checked.replay_state import hold_target, logger
from hyperpar.offload.capture.mode.executor_base import internal
from hyperpar.offload.capture.ops.errors import OffloadDivergenceError
from hyperpar.offload.capture.ops.op_args import tensor_inputs, written_tensors
from hyperpar.offload.capture.ops.op_identity import COLLECTIVE, op_kind, op_name

Tensor = torch.Tensor


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


class ReplaySwitch(ReplayGrowth):
    """Picking, switching and leaving plans."""

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
        self._hold_to(hold_target(self.budget_bytes, alt))
        self._note_growth()
        if self.relieved:
            self.start_online()

    def _switch_to_shorter(self) -> None:
        """The step ended early: it may be a known plan that is a prefix of this one."""
        i, p = self.index, self.program
        for alt in self.alternatives:
            if alt.num_ops == i and (i == 0 or alt.prefix[i - 1] == p.prefix[i - 1]):
                self._adopt(alt)
                return

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
