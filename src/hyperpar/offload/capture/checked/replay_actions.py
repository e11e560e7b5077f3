"""Following the plan around one op: its action lists, its moved inputs, its new storages.

Shared by the per-op path (``replay``) and plan-following opaque regions (``replay_regions``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from hyperpar.offload.capture.checked.replay_program import (
    D2H,
    H2D,
    HAS_POST,
    HAS_WRITES,
    RELEASE,
    RELEASE_FINAL,
    ReplayProgram,
)
from hyperpar.offload.capture.checked.replay_switch import ReplaySwitch


class ReplayActions(ReplaySwitch):
    """The plan's actions, copies and bindings around an op."""

    def _reap(self, i: int) -> None:
        """Free the device bytes finished copies let go of; where releases still in flight
        leave no room for op ``i``'s outputs within the budget, wait for the oldest of them."""
        m = self.manager
        m.reap()
        if m.pending_bytes:
            over = self.resident_bytes() + self.program.made[i] - self._top
            if over > 0:
                m.free_pending_until(over)

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
