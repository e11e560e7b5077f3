"""What every planner is: something that turns a trace into a schedule."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule


@runtime_checkable
class Planner(Protocol):
    """``build`` must return a schedule with one pre and one post list per trace op.

    The budget is ``trace.memory_limit_bytes``.
    """

    name: str

    def build(self, trace: ActivationTrace) -> ResidencySchedule: ...
