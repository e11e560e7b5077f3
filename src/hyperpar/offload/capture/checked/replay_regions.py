"""Replay of opaque regions (``skip_offload``, compiled regions) as one op each.

A region follows the plan when it touches the storages the plan's region did; its inner
ops run untraced, and their accesses mark host copies stale as they happen. A region that
touched others may be another known plan's (data decides what a region touches), else the
step diverges there and the region is recorded as it ran.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hyperpar.offload.capture.checked.replay_actions import ReplayActions
from hyperpar.offload.capture.checked.replay_program import HAS_MOVED, HAS_PRE, HAS_WRITES
from hyperpar.offload.capture.checked.replay_state import PlanRegion
from hyperpar.offload.capture.mode.online_path import OpState
from hyperpar.offload.capture.ops.activation_table import live_ids, read_ids
from hyperpar.offload.ir import AccessKind

Tensor = torch.Tensor
READ, WRITE = AccessKind.READ, AccessKind.WRITE


class ReplayRegions(ReplayActions):
    """Opaque regions while the step follows its plan."""

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
        for st in reads:
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
        region = PlanRegion(i, kinds, read_ids(reads))
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
        region: PlanRegion = token
        region.in_ids = live_ids(region.in_ids)  # a read that died inside may share an output's id
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

    def _switch_region(self, region: PlanRegion, leaves: list[Tensor]) -> bool:
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

    def _region_accesses(self, region: PlanRegion, leaves: list[Tensor],
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

    def _record_region(self, region: PlanRegion, leaves: list[Tensor]) -> None:
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
