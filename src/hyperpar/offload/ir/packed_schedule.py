"""A ResidencySchedule packed into flat arrays, as a session keeps it between steps.

Two lists per op and an object per action cost about a hundred bytes per access of the
trace; the packed form costs a few, and the objects are rebuilt when
``OffloadSession.schedule`` is asked for.
"""

from __future__ import annotations

import weakref
from array import array
from dataclasses import fields
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
        self.start, self.kind, self.sid = packed_actions(schedule)
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
            lists = _action_lists(self.start, self.kind, self.sid)
            schedule = ResidencySchedule(
                pre=lists[0::2], post=lists[1::2], planner=self.planner, budget_bytes=self.budget_bytes,
                predicted_peak_bytes=self.predicted_peak_bytes, deficit_bytes=self.deficit_bytes,
                deficit_op=self.deficit_op, notes=self.notes,
            )
            self._unpacked = weakref.ref(schedule)
        return schedule


def last_copy_in(packed: PackedSchedule) -> dict[int, int]:
    """Storage id -> the op of its last ``COPY_H2D`` in the schedule: the order in which backward
    needs the host copies back, which the disk tier spills and reads back by."""
    code = _CODE[ResidencyActionType.COPY_H2D]
    bounds = packed.start.tolist()
    out: dict[int, int] = {}
    segment = 0
    for j, k in enumerate(packed.kind):
        if k != code:
            continue
        while bounds[segment + 1] <= j:
            segment += 1
        out[packed.sid[j]] = segment // 2
    return out


def _action_lists(start: array, kind: bytes, sid: array) -> list[list[ResidencyAction]]:
    """The pre and post lists, interleaved, as objects."""
    acts = list(map(ResidencyAction, map(KINDS.__getitem__, kind), sid))
    bounds = start.tolist()
    return list(map(acts.__getitem__, map(slice, bounds[:-1], bounds[1:])))


class PackedActionsSchedule(ResidencySchedule):
    """A ``ResidencySchedule`` made from packed actions, whose per-op lists of action objects are
    made only when first asked for: planning a 300k-op step never needs them (``simulate`` and
    ``PackedSchedule`` read the arrays), and making them costs more than the planning they
    would serve. Once made (or set), the lists are the schedule and the arrays are dropped."""

    def __init__(self, *args: Any, packed: tuple[array, bytes, array] | None = None, **kwargs: Any) -> None:
        self._packed = packed
        if packed is None:  # as a plain ResidencySchedule (``dataclasses.replace`` comes here)
            super().__init__(*args, **kwargs)
            return
        self._pre: list[list[ResidencyAction]] = []
        self._post: list[list[ResidencyAction]] = []
        fields = {"planner": "", "budget_bytes": 0, "predicted_peak_bytes": 0, "deficit_bytes": 0,
                  "deficit_op": None, "notes": None, **kwargs}
        for name, value in fields.items():
            setattr(self, name, {} if name == "notes" and value is None else value)

    def _lists(self) -> tuple[list[list[ResidencyAction]], list[list[ResidencyAction]]]:
        if self._packed is not None:
            lists = _action_lists(*self._packed)
            self._pre, self._post, self._packed = lists[0::2], lists[1::2], None
        return self._pre, self._post

    @property  # type: ignore[override]
    def pre(self) -> list[list[ResidencyAction]]:
        return self._lists()[0]

    @pre.setter
    def pre(self, value: list[list[ResidencyAction]]) -> None:
        if self._packed is not None:
            self._lists()
        self._pre = value

    @property  # type: ignore[override]
    def post(self) -> list[list[ResidencyAction]]:
        return self._lists()[1]

    @post.setter
    def post(self, value: list[list[ResidencyAction]]) -> None:
        if self._packed is not None:
            self._lists()
        self._post = value

    @property
    def num_ops(self) -> int:
        packed = self._packed
        return (len(packed[0]) - 1) // 2 if packed is not None else len(self._pre)

    def __eq__(self, other: object) -> bool:  # equal to a plain schedule with the same fields
        if not isinstance(other, ResidencySchedule):
            return NotImplemented
        names = [f.name for f in fields(ResidencySchedule)]
        return [getattr(self, n) for n in names] == [getattr(other, n) for n in names]

    __hash__ = None  # type: ignore[assignment]


def packed_actions(schedule: ResidencySchedule) -> tuple[array, bytes, array]:
    """(start, kind, sid) of ``schedule``'s actions, as ``PackedSchedule`` lays them out: the
    arrays of a ``PackedActionsSchedule`` whose lists were never made, else packed from them."""
    if isinstance(schedule, PackedActionsSchedule) and schedule._packed is not None:
        return schedule._packed
    start, kinds, sid = array("q", [0]), bytearray(), array("q")
    code = _CODE
    for pre, post in zip(schedule.pre, schedule.post, strict=True):
        for acts in (pre, post):
            for a in acts:
                kinds.append(code[a.kind])
                sid.append(a.storage_id)
            start.append(len(sid))
    return start, bytes(kinds), sid


def action_count(schedule: ResidencySchedule) -> int:
    if isinstance(schedule, PackedActionsSchedule) and schedule._packed is not None:
        return len(schedule._packed[2])
    return sum(map(len, schedule.pre)) + sum(map(len, schedule.post))
