"""Replay's state and the checks of a step against its plan, under every replay path.

The lowest of replay's layers (``replay_state`` < ``replay_growth`` < ``replay_switch`` <
``replay_actions`` < ``replay_regions`` < ``replay``): each file holds one path of
``ReplayExecutor`` and calls only the layers below it. They are subclasses, not helper
objects, so the hot path (``ReplayExecutor.run_op``) reaches every method and attribute as
directly as when all of it was one class.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

import torch

from hyperpar.offload.capture.checked.replay_program import ReplayProgram
from hyperpar.offload.capture.mode.executor_base import ExecutorBase
from hyperpar.offload.ir import AccessKind
from hyperpar.offload.ir.guide import NO_STORAGE, NOT_ACTIVATION
from hyperpar.offload.runtime import ResidencyManager

# One logger for every replay path, under the name users and tests filter on.
logger = logging.getLogger("hyperpar.offload.capture.checked.replay")
Tensor = torch.Tensor
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


def hold_target(budget: int, program: ReplayProgram) -> int:
    """What replay holds to: the budget, or the floor at the plan's sizes where the budget is
    below it (instant copies: whatever peak the timed plan predicted from measured times,
    copies slower than it assumed are waited for, not paid in memory); without a floor, the
    plan's own peak."""
    if program.floor_bytes:
        return max(budget, program.floor_bytes)
    return max(budget, program.planned_peak)


def _limit(top: int) -> int:
    return top + max(SLACK_BYTES, top // 50)


class PlanRegion:
    """A plan-following opaque region: the sids its inner ops touched."""

    __slots__ = ("in_ids", "index", "kinds")

    def __init__(self, index: int, kinds: dict[int, AccessKind], in_ids: Collection[int]) -> None:
        self.index, self.kinds, self.in_ids = index, kinds, in_ids


class ReplayState(ExecutorBase):
    """What a replayed step knows: its plan, the other known plans, how far it left them."""

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
        self._replay_regions: list[PlanRegion] = []
        self._careful = False  # _growth, relieved or _grew: ops make room first (``_make_room``)
        # an op made more than planned (``_outgrown``), or the plan's peak is above what the
        # step holds to (``_hold_to``)
        self._grew = False
        self._top = self._limit = 0
        self._hold_to(hold_target(budget_bytes, program))
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

    def _hold_to(self, top: int) -> None:
        """The bytes this step holds to (``_top``), and the limit above which it evicts beyond
        its plan (that plus the slack). A plan whose own peak is above it (a timed plan that
        expected slow copies to cost memory) is followed carefully: room before every op."""
        self._top, self._limit = top, _limit(top)
        if self.program.planned_peak > self._limit:
            self._grew = self._careful = True

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
