"""The feasible floor of a trace, split into what keeps it there, in words a user can act on.

``bounds.min_resident_bytes`` gives, per op, the bytes no schedule can move off the
device. Its maximum is the least budget any schedule can meet. At the op where it is
reached the floor is made of two things: storages kept after the step and never read
again (parameter ``.grad`` tensors created in backward, the loss, outputs the caller
keeps; nothing can bring them back before the step ends, so they cannot leave), and the
op's own working set (every storage it reads or writes must be on the device while it
runs). Everything else alive at that op is what a plan can move, tails included (storages
Python holds past their last access and lets go of within the step: a plan takes them off
after that access when it needs the room, ``planning.tails``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hyperpar.offload.ir import ActivationTrace, StepReport
from hyperpar.offload.planning.arrays import arrays_given, resident_without_offload, trace_arrays
from hyperpar.offload.planning.bounds import min_resident_bytes
from hyperpar.offload.planning.tails import tails_taken

MIB = 1 << 20


@dataclass(frozen=True)
class BudgetFloor:
    floor_bytes: int  # the least budget any schedule can meet (min_feasible_budget)
    op: int | None  # the op where the floor is reached (None for an empty trace)
    op_name: str
    retained_bytes: int  # of the floor: kept after the step, past their last access
    working_set_bytes: int  # of the floor: what the op reads and writes
    peak_bytes: int  # activation peak of the trace without offload

    def as_dict(self) -> dict[str, int | str | None]:
        return asdict(self)

    def annotate(self, report: StepReport) -> None:
        report.min_feasible_budget_bytes = self.floor_bytes
        report.unmovable_retained_bytes = self.retained_bytes
        report.unmovable_working_set_bytes = self.working_set_bytes

    def describe(self) -> str:
        """The floor and its two parts, in MiB."""
        if self.op is None:
            return "the trace has no ops: any budget can be met"
        return (f"floor {self.floor_bytes / MIB:.2f} MiB at op {self.op} ({self.op_name}): "
                f"{self.retained_bytes / MIB:.2f} MiB kept after the step (parameter gradients, the loss, "
                f"outputs still referenced) + {self.working_set_bytes / MIB:.2f} MiB the op's own inputs "
                f"and outputs; peak without offload {self.peak_bytes / MIB:.2f} MiB")

    def below_fast_floor_message(self, budget_bytes: int, general: BudgetFloor) -> str:
        """For the floor of the fast path (``self``), at or above the general one."""
        return (f"the budget of {budget_bytes / MIB:.2f} MiB is below the fast path's floor of "
                f"{self.floor_bytes / MIB:.2f} MiB (the least budget a plan moving only storages autograd "
                f"saves can meet; any plan: {general.floor_bytes / MIB:.2f} MiB): steps keep the budget on "
                f"the checked replay, at several times the host cost of plain PyTorch per op; "
                f"{self.floor_bytes / MIB:.2f} MiB or more keeps them on the fast path")

    def below_floor_message(self, budget_bytes: int) -> str:
        return (f"the budget of {budget_bytes / MIB:.2f} MiB is below the feasible floor of "
                f"{self.floor_bytes / MIB:.2f} MiB: no schedule can keep fewer activation bytes on the "
                f"device, so every step will be over budget; use at least {self.floor_bytes / MIB:.2f} MiB "
                f"({self.describe()})")


def budget_floor(trace: ActivationTrace) -> BudgetFloor:
    arrays = trace_arrays(trace)
    resident = resident_without_offload(arrays)
    peak = int(resident.max()) if len(resident) else 0
    trace, arrays = tails_taken(trace, arrays)
    with arrays_given(trace, arrays):
        floor = min_resident_bytes(trace)
    if not floor:
        return BudgetFloor(0, None, "", 0, 0, peak)
    op = max(range(len(floor)), key=floor.__getitem__)  # the first op where the floor is reached
    sizes = trace.storage_sizes
    working = sum(sizes.get(acc.storage_id, 0) for acc in trace.ops[op].accesses)
    return BudgetFloor(floor_bytes=floor[op], op=op, op_name=trace.ops[op].name,
                       retained_bytes=floor[op] - working, working_set_bytes=working, peak_bytes=peak)
