"""A ResidencySchedule packed into flat arrays, as a session keeps it between steps.

Two lists per op and an object per action cost about a hundred bytes per access of the
trace; the packed form costs a few, and the objects are rebuilt when
``OffloadSession.schedule`` is asked for.
"""

from __future__ import annotations

import weakref
from array import array
from typing import Any

from hyperpar.offload.ir.schedule import ResidencyAction, ResidencyActionType, ResidencySchedule

KINDS = tuple(ResidencyActionType)
_CODE = {kind: code for code, kind in enumerate(KINDS)}


class PackedSchedule:
    """Op ``i``'s pre actions are ``kind/sid[start[2i]:start[2i+1]]``, its post actions
    ``[start[2i+1]:start[2i+2]]``; ``kind`` holds indexes into ``KINDS``."""

    __slots__ = ("__weakref__", "_unpacked", "budget_bytes", "deficit_bytes", "deficit_op", "kind", "notes",
                 "planner", "predicted_peak_bytes", "sid", "start")

    def __init__(self, schedule: ResidencySchedule) -> None:
        start, kind, sid = array("q", [0]), bytearray(), array("q")
        code = _CODE
        for pre, post in zip(schedule.pre, schedule.post, strict=True):
            for acts in (pre, post):
                for a in acts:
                    kind.append(code[a.kind])
                    sid.append(a.storage_id)
                start.append(len(sid))
        self.start, self.kind, self.sid = start, bytes(kind), sid
        self.planner = schedule.planner
        self.budget_bytes = schedule.budget_bytes
        self.predicted_peak_bytes = schedule.predicted_peak_bytes
        self.deficit_bytes = schedule.deficit_bytes
        self.deficit_op = schedule.deficit_op
        self.notes: dict[str, Any] = schedule.notes
        self._unpacked: weakref.ref[ResidencySchedule] = weakref.ref(schedule)

    @property
    def num_ops(self) -> int:
        return (len(self.start) - 1) // 2

    def unpack(self) -> ResidencySchedule:
        """The schedule as objects; the same object while someone still holds the last one."""
        schedule = self._unpacked()
        if schedule is None:
            start, kind, sid = self.start, self.kind, self.sid
            lists = [[ResidencyAction(KINDS[kind[k]], sid[k]) for k in range(start[j], start[j + 1])]
                     for j in range(len(start) - 1)]
            schedule = ResidencySchedule(
                pre=lists[0::2], post=lists[1::2], planner=self.planner, budget_bytes=self.budget_bytes,
                predicted_peak_bytes=self.predicted_peak_bytes, deficit_bytes=self.deficit_bytes,
                deficit_op=self.deficit_op, notes=self.notes,
            )
            self._unpacked = weakref.ref(schedule)
        return schedule
