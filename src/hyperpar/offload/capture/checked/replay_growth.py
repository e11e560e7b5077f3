"""Replay of a step larger than its plan, or holding more than it: making room.

A step can outgrow its plan (another batch size or length than the plan's, an op making
more than planned) or hold more than its limit (a release that could not happen). From
then on it is *careful*: every op makes room for what it is about to make before it runs.
Past its limit it is also *relieved*: it evicts beyond the plan the way warmup does, every
op pages in its inputs and marks its writes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import torch

from hyperpar.offload.capture.checked.replay_state import ON_DEMAND_GROWTH, SLACK_BYTES, ReplayState, logger
from hyperpar.offload.capture.mode.executor_base import internal
from hyperpar.offload.capture.ops.op_args import written_tensors
from hyperpar.offload.runtime import StorageEntry

Tensor = torch.Tensor


class ReplayGrowth(ReplayState):
    """The careful and relieved modes of a replayed step."""

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
        resident = self.resident_bytes()
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

    def _evictable_again(self, entries: Sequence[StorageEntry]) -> None:
        """Storages back on the device after evicting beyond the plan may be evicted again
        (the oldest first, as any other): without this, what came back stayed for the rest of
        the step and the budget could not be kept."""
        if self.relieved:
            pinned, producer, heap = self.table.pinned, self.table.producer, self._heap
            for entry in entries:
                if entry.sid not in pinned:
                    heapq.heappush(heap, (producer[entry.sid], -entry.nbytes, entry.sid))

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
