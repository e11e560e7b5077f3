"""What a session keeps per step structure: its plans (one per size class), and the running
fast step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hyperpar.offload.capture import ReplayProgram
from hyperpar.offload.capture.checked.prefix_hash import key_hashes
from hyperpar.offload.capture.fast.fast_moves import MovingStep
from hyperpar.offload.capture.fast.fast_schedule import EventLog, MoveSchedule
from hyperpar.offload.capture.fast.saved_tensor_guard import Fingerprint, SavedTensorGuard
from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.ir.packed import PackedTrace
from hyperpar.offload.ir.packed_schedule import PackedSchedule
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.planning.disk_plan import DiskPlan
from hyperpar.offload.planning.floor import BudgetFloor


@dataclass(slots=True)
class FastStep:
    plan: Plan
    guard: SavedTensorGuard
    t0: float
    thread: int  # the step's thread (a departure elsewhere cannot switch it to the mode)
    moving: MovingStep | None = None  # the plan's moves at saved-tensor events (a plan that moves bytes)
    missed: Fingerprint | None = None  # the first saved tensor, where no plan covered it
    checked_ops: int = 0  # ops the step ran checked before its first saved tensor chose this plan


@dataclass(eq=False)
class Plan:
    signature: int  # the structure's
    packed: PackedTrace  # the trace and schedule, packed (objects cost several times more)
    packed_schedule: PackedSchedule
    program: ReplayProgram
    predicted_ms: float
    total_bytes: int  # of every activation, at the sizes it was planned for
    floor: BudgetFloor
    # the saved tensors' fingerprints of a clean checked replay of this plan: later steps may
    # take the fast path (``capture.fast.fast_replay``); a plan that moves bytes needs its moves at
    # saved-tensor events too (``capture.fast.fast_moves``), else ``fast_refusal`` says why not
    packs: tuple[Fingerprint, ...] | None = None
    move_schedule: MoveSchedule | None = None
    fast_refusal: str | None = None
    events: EventLog | None = None  # the saved-tensor events its schedule was placed on (frozen)
    refinements: int = 0  # re-plans that kept storages on the device for the fast path
    kept_for_fast: frozenset[int] = frozenset()  # the storages those re-plans kept
    # the floor with every storage the fast path cannot move pinned (from the first checked
    # replay's saved-tensor events): budgets at or above it can run fast
    fast_floor: BudgetFloor | None = None
    # storage id -> the op of its last copy back to the device: the disk tier's order (made once)
    copy_in: dict[int, int] | None = None
    host_peak: int = 0  # the most host bytes its copies hold at once (``planning.host_tier.host_peak``)
    disk_plan: DiskPlan | None = None  # with a host budget below ``host_peak``: the copies that must go
    kept_bytes: int = 0  # retained after the step (parameter gradients, the loss, outputs)
    movable_peak_bytes: int = 0  # the peak of the rest, without offload

    def annotate(self, report: StepReport) -> None:
        """The report's floors (the general one and, once known, the fast path's) and the
        peak they are shares of, with the kept bytes beside it."""
        self.floor.annotate(report)
        report.kept_bytes, report.movable_peak_bytes = self.kept_bytes, self.movable_peak_bytes
        if self.fast_floor is not None:
            report.fast_path_floor_bytes = self.fast_floor.floor_bytes

    @property
    def moves(self) -> bool:
        return bool(self.program.act_code)

    @property
    def trace(self) -> ActivationTrace:
        """As recorded: the schedule's tails (see ``planning.tails``) are not marked in it."""
        return self.packed.unpack()

    @property
    def schedule(self) -> ResidencySchedule:
        return self.packed_schedule.unpack()


@dataclass(eq=False)
class Structure:
    keys: list[object]
    sizes: dict[int, Plan]  # size bucket -> plan
    last: Plan  # the plan its last step followed
    departures: int = 0  # fast steps that departed from their plan (sizes vary here: stay checked)
    # steps to check before going fast again: a step of a size whose plan has not run a clean
    # checked replay yet fell back at its first saved tensor, so its plan needs one
    to_learn: int = 0
    size_misses: int = 0  # such fallbacks in a row (a fast step or a learned plan resets it)
    # the first saved tensor of the fallback that began the learning steps: they taught it
    # if a plan's now covers it
    missed: Fingerprint | None = None
    learn_skips: int = 0  # such fallbacks still to pass without learning steps (``learn_backoff``)
    learn_backoff: int = 0  # fallbacks passed after the last learning steps (0: they taught their length)
    # its lengths vary: each step starts checked and goes fast at its first saved tensor where a
    # plan covers that (``FastSteps._hand_off``), so a length no plan covers is checked, not a fallback
    varies: bool = False


def signature_of(packed: PackedTrace, keys: list[object]) -> int:
    """Everything replay checks (ops, inputs, outputs' dtypes and ranks, storage accesses,
    pins), not sizes or timings: the packed structure's columns, each output shape by its rank."""
    st = packed.structure
    ranked: dict[tuple[object, ...], int] = {}  # output meta with ranks for shapes -> its number
    numbers = np.array([ranked.setdefault(tuple(None if m is None else (len(m[0]), m[1]) for m in metas),
                                          len(ranked)) for metas in st.metas], dtype=np.int64)
    per_op = numbers[np.frombuffer(st.meta_index, dtype=np.int64)] if len(numbers) else numbers
    return hash((
        tuple(key_hashes(keys)), tuple(ranked), per_op.tobytes(), st.has_guides, st.leaf_count.tobytes(),
        st.bind_start.tobytes(), st.bind_leaf.tobytes(), st.bind_sid.tobytes(),
        st.input_start.tobytes(), st.input_sid.tobytes(),
        st.access_start.tobytes(), st.access_sid.tobytes(), st.access_write,
        packed.pinned_sids,
    ))
