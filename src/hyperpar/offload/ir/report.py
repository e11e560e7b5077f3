"""What one step did: memory against the budget, bytes moved, faults, time."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hyperpar.offload.ir.json_io import IRFormatError, read_json, write_json


@dataclass
class StepReport:
    phase: str
    op_count: int
    # Warmup: measured over every tracked activation. Replay: the trace's per-op resident
    # bytes minus what the residency manager has actually moved off the device.
    peak_resident_bytes: int
    budget_bytes: int
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    demand_faults: int = 0
    exposed_wait_ms: float = 0.0
    step_ms: float = 0.0
    predicted_step_ms: float | None = None
    overshoot_bytes: int = 0  # max(peak - budget, 0)
    overshoot_op: int | None = None
    offload_cap_hits: int = 0
    diverged_at: int | None = None  # first op that did not match the trace (replay)
    # The plan's trace: the least budget any schedule can meet, and its two unmovable parts
    # at the op where it is reached (None before a plan exists). planning.floor fills them.
    min_feasible_budget_bytes: int | None = None
    unmovable_retained_bytes: int | None = None  # kept after the step: parameter .grad, loss, outputs
    unmovable_working_set_bytes: int | None = None  # what that op itself reads and writes
    # The least budget a plan the fast path can run meets: one that moves only storages
    # autograd saves and Python lets go of (known from the first checked replay on; None before)
    fast_path_floor_bytes: int | None = None
    # Replay: "checked" (every op through the dispatch mode), "fast" (no dispatch mode: saved
    # tensors fingerprinted and the plan's copies run at autograd's pack and unpack; the peak
    # is the plan's, as every saved tensor matched it, plus bytes Python held past their
    # release) or "fallback" (a fast step that departed from its plan at saved tensor
    # ``departed_at_saved``, or found a released storage still held over the budget, and
    # finished on the online path: its peak counts what it saw from there, the saved
    # tensors before it included; its floor is unknown). None for warmup.
    replay_path: str | None = None
    departed_at_saved: int | None = None
    # A fast step of a structure whose lengths vary: ops it ran on the checked replay before
    # its first saved tensor picked the plan that covers its length (where none covers it,
    # the step stays checked and that plan learns it)
    checked_prefix_ops: int = 0
    # A fast step whose plan moves bytes: bytes it released that Python still held (so they
    # stayed on the device) when they no longer fit the budget or at the end of forward. The
    # session plans again with those storages kept, or checks that plan's steps from then on.
    held_past_release_bytes: int = 0
    # Bytes the step's checkpointed module calls did not keep for backward (rebuilt there
    # instead), as the plan counted them on the first trace; 0 without recompute.
    bytes_recomputed: int = 0
    # Once calls are rebuilt: the floor of the step without them (offload alone; the floor
    # above is the rebuilt step's), so the two levers' least budgets stand side by side
    offload_only_floor_bytes: int | None = None
    # The plan's trace: the bytes kept after the step (parameter gradients, the loss, outputs)
    # and the peak of the others without offload, the movable activation peak that
    # ``max_resident_fraction`` is a share of (None before a plan exists)
    kept_bytes: int | None = None
    movable_peak_bytes: int | None = None
    # The disk tier (``OffloadConfig(max_host_activation_mb=..., disk_dir=...)``): bytes
    # written to and read back from disk, and the host bytes held at the step's peak for
    # activations (host slabs, pinned or not, and the disk tier's staging buffer)
    bytes_to_disk: int = 0
    bytes_from_disk: int = 0
    peak_host_bytes: int = 0
    # the disk tier's I/O thread: time spent writing and reading those bytes (their bandwidth
    # is bytes over time; the time overlaps compute unless the step waited for it)
    disk_write_ms: float = 0.0
    disk_read_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        mib = 1 << 20
        text = (
            f"{self.phase}: {self.op_count} ops, peak {self.peak_resident_bytes / mib:.1f} MiB / "
            f"budget {self.budget_bytes / mib:.1f} MiB, d2h {self.bytes_d2h / mib:.1f} MiB, "
            f"h2d {self.bytes_h2d / mib:.1f} MiB, {self.demand_faults} faults, {self.step_ms:.1f} ms"
        )
        if self.overshoot_bytes:
            text += f", over budget by {self.overshoot_bytes / mib:.2f} MiB at op {self.overshoot_op}"
        if self.offload_cap_hits:
            text += f", {self.offload_cap_hits} host cap hits"
        if self.diverged_at is not None:
            text += f", diverged at op {self.diverged_at}"
        if self.min_feasible_budget_bytes is not None:
            text += (f", floor {self.min_feasible_budget_bytes / mib:.1f} MiB "
                     f"({(self.unmovable_retained_bytes or 0) / mib:.1f} retained + "
                     f"{(self.unmovable_working_set_bytes or 0) / mib:.1f} working set)")
        if self.offload_only_floor_bytes is not None:
            text += f" (offload only: {self.offload_only_floor_bytes / mib:.1f} MiB)"
        if self.fast_path_floor_bytes is not None:
            text += f", fast-path floor {self.fast_path_floor_bytes / mib:.1f} MiB"
        if self.movable_peak_bytes is not None:
            text += (f", movable peak {self.movable_peak_bytes / mib:.1f} MiB + "
                     f"{(self.kept_bytes or 0) / mib:.1f} MiB kept")
        if self.bytes_recomputed:
            text += f", recomputed {self.bytes_recomputed / mib:.1f} MiB"
        if self.bytes_to_disk or self.bytes_from_disk:
            text += (f", disk {self.bytes_to_disk / mib:.1f} MiB out / {self.bytes_from_disk / mib:.1f} "
                     f"MiB in, host peak {self.peak_host_bytes / mib:.1f} MiB")
        return text

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str = "report") -> StepReport:
        known = {f.name for f in fields(cls)}
        missing = {"phase", "op_count", "peak_resident_bytes", "budget_bytes"} - doc.keys()
        if missing:
            raise IRFormatError(f"{where}: missing field(s) {sorted(missing)}")
        try:
            return cls(**{k: v for k, v in doc.items() if k in known})
        except TypeError as exc:
            raise IRFormatError(f"{where}: {exc}") from exc

    def save(self, path: str | Path) -> None:
        write_json(path, "report", self.as_dict())

    @classmethod
    def load(cls, path: str | Path) -> StepReport:
        return cls.from_dict(read_json(path, "report"), where=str(path))
