"""The planner's output: per-op actions run just before (pre) and just after (post) an op.

Semantics shared by the runtime, ``simulate`` and ``verify``:
- COPY_D2H s: start copying s's current device bytes to its host copy (s stays resident).
- RELEASE_DEVICE s: drop s's device memory. If s is accessed again, a COPY_D2H issued
  after s's last write must precede it; after s's last access it needs none.
- COPY_H2D s: allocate s on the device again and copy its host copy in; the op that
  next reads s waits for that copy.
- RELEASE_HOST s: drop s's host copy.
Actions of one list run in order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperpar.offload.ir.json_io import (
    IRFormatError,
    non_negative_int,
    read_json,
    write_json,
)
from hyperpar.offload.ir.json_io import (
    field as json_field,
)


class ResidencyActionType(str, enum.Enum):
    COPY_D2H = "copy_d2h"
    COPY_H2D = "copy_h2d"
    RELEASE_DEVICE = "release_device"
    RELEASE_HOST = "release_host"


@dataclass(frozen=True, slots=True)
class ResidencyAction:
    kind: ResidencyActionType
    storage_id: int


@dataclass
class ResidencySchedule:
    pre: list[list[ResidencyAction]]
    post: list[list[ResidencyAction]]
    planner: str = ""
    budget_bytes: int = 0
    # The planner's own figure for the worst op (see simulate() for the exact one).
    predicted_peak_bytes: int = 0
    # > 0 when the budget could not be met: by how much, and at which op.
    deficit_bytes: int = 0
    deficit_op: int | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.pre) != len(self.post):
            raise ValueError(f"pre has {len(self.pre)} ops but post has {len(self.post)}")

    @classmethod
    def empty(cls, num_ops: int, planner: str = "") -> ResidencySchedule:
        return cls(pre=[[] for _ in range(num_ops)], post=[[] for _ in range(num_ops)],
                   planner=planner)

    @property
    def num_ops(self) -> int:
        return len(self.pre)

    def actions(self) -> list[tuple[int, str, ResidencyAction]]:
        """Every action as (op, "pre" | "post", action), in execution order."""
        out = []
        for i in range(self.num_ops):
            out.extend((i, "pre", a) for a in self.pre[i])
            out.extend((i, "post", a) for a in self.post[i])
        return out

    def moved_sids(self) -> frozenset[int]:
        """Storages the schedule ever copies to host (the ones replay has to track)."""
        return frozenset(
            a.storage_id
            for acts in self.post + self.pre
            for a in acts
            if a.kind is ResidencyActionType.COPY_D2H
        )

    # --- JSON -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def enc(lists: list[list[ResidencyAction]]) -> list[list[list[Any]]]:
            return [[[a.kind.value, a.storage_id] for a in acts] for acts in lists]

        return {
            "pre": enc(self.pre),
            "post": enc(self.post),
            "planner": self.planner,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "deficit_bytes": self.deficit_bytes,
            "deficit_op": self.deficit_op,
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str = "schedule") -> ResidencySchedule:
        def dec(name: str) -> list[list[ResidencyAction]]:
            out = []
            for i, acts in enumerate(json_field(doc, name, list, where)):
                if not isinstance(acts, list):
                    raise IRFormatError(f"{where}: {name}[{i}] is not a list")
                row = []
                for a in acts:
                    if not (isinstance(a, list) and len(a) == 2):
                        raise IRFormatError(f"{where}: {name}[{i}] entry {a!r} is not [kind, sid]")
                    try:
                        kind = ResidencyActionType(a[0])
                    except ValueError as exc:
                        raise IRFormatError(f"{where}: {name}[{i}] unknown action {a[0]!r}") from exc
                    row.append(ResidencyAction(kind, non_negative_int(a[1], f"{where}: {name}")))
                out.append(row)
            return out

        pre, post = dec("pre"), dec("post")
        if len(pre) != len(post):
            raise IRFormatError(f"{where}: pre has {len(pre)} ops but post has {len(post)}")
        deficit_op = doc.get("deficit_op")
        notes = doc.get("notes", {})
        if not isinstance(notes, dict):
            raise IRFormatError(f"{where}: field 'notes' must be an object, got {notes!r}")
        return cls(
            pre=pre,
            post=post,
            planner=str(doc.get("planner", "")),
            budget_bytes=non_negative_int(doc.get("budget_bytes", 0), f"{where}: budget_bytes"),
            predicted_peak_bytes=non_negative_int(
                doc.get("predicted_peak_bytes", 0), f"{where}: predicted_peak_bytes"
            ),
            deficit_bytes=non_negative_int(doc.get("deficit_bytes", 0), f"{where}: deficit"),
            deficit_op=None if deficit_op is None else non_negative_int(deficit_op, where),
            notes=dict(notes),
        )

    def save(self, path: str | Path) -> None:
        write_json(path, "schedule", self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> ResidencySchedule:
        return cls.from_dict(read_json(path, "schedule"), where=str(path))
