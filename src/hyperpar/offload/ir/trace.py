"""What warmup saw: ops in order, the activation storages each op touched, and sizes.

Planners, the simulator and the verifier read only this; capture writes it. A storage
id (sid) names one activation storage (a storage first seen as an op output). Its
lifetime for planning is from its first access (the producing op, which allocates it)
to its last access, or to the end of the step if it is retained (still referenced
when the step ended: loss, gradients, outputs the user kept).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperpar.offload.ir.guide import OpGuide
from hyperpar.offload.ir.json_io import (
    IRFormatError,
    non_negative_float,
    non_negative_int,
    read_json,
    write_json,
)
from hyperpar.offload.ir.json_io import (
    field as json_field,
)


class AccessKind(str, enum.Enum):
    READ = "read"
    WRITE = "write"


@dataclass(frozen=True, slots=True)
class StorageAccess:
    op_id: int
    storage_id: int
    kind: AccessKind


@dataclass(slots=True)
class TraceOp:
    """One dispatched op. ``accesses`` holds at most one entry per storage (WRITE wins)."""

    name: str
    duration_ms: float
    accesses: tuple[StorageAccess, ...] = ()


@dataclass
class ActivationTrace:
    ops: list[TraceOp]
    storage_sizes: dict[int, int]
    retained_sids: frozenset[int] = frozenset()
    memory_limit_bytes: int = 0
    d2h_bandwidth_gbps: float = 0.0
    h2d_bandwidth_gbps: float = 0.0
    # One guide per op when the trace came from a real step; empty for synthetic traces.
    guides: list[OpGuide] = field(default_factory=list)
    # Storages that must stay on the device for the whole step: buffers of collectives,
    # storages shared with sparse or other storage-less tensors, storages read behind the
    # dispatcher. Planners never move them.
    pinned_sids: frozenset[int] = frozenset()
    # sid -> the last op during which the storage was still alive, where that is later than
    # its last access (Python held it a while longer); it occupies the device until then.
    death_ops: dict[int, int] = field(default_factory=dict)
    # Storages held past their last access that the plan takes off the device right after it
    # (copied out after their last write, never brought back; see ``planning.tails``): their
    # lifetime on the device ends at that access, whatever ``death_ops`` says.
    tail_sids: frozenset[int] = frozenset()
    # The budget covers the bytes kept after the step (``retained_sids``) from the step's
    # start, not only once they exist: a budget on the movable bytes (``max_resident_fraction``
    # of their peak) plus what the step keeps. Planning counts a retained storage's bytes
    # before its first access too (``planning.arrays.TraceArrays.reserve_bytes``).
    reserve_retained: bool = False

    def __post_init__(self) -> None:
        self.retained_sids = frozenset(self.retained_sids)
        self.pinned_sids = frozenset(self.pinned_sids)
        self.tail_sids = frozenset(self.tail_sids)

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def lifetimes(self) -> dict[int, tuple[int, int]]:
        """sid -> (first op, last op it occupies the device) inclusive: its last access, or
        later when it died later (``death_ops``) unless it is a tail; retained storages live to
        the last op."""
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, op in enumerate(self.ops):
            for acc in op.accesses:
                first.setdefault(acc.storage_id, i)
                last[acc.storage_id] = i
        end = len(self.ops) - 1
        for sid, death in self.death_ops.items():
            if sid in last and death > last[sid] and sid not in self.tail_sids:
                last[sid] = min(death, end)
        for sid in self.retained_sids:
            if sid in first:
                last[sid] = end
        return {sid: (first[sid], last[sid]) for sid in first}

    def resident_bytes_without_offload(self) -> list[int]:
        """Activation bytes alive at each op when nothing is offloaded (difference array)."""
        n = len(self.ops)
        delta = [0] * (n + 1)
        for sid, (lo, hi) in self.lifetimes().items():
            size = self.storage_sizes.get(sid, 0)
            delta[lo] += size
            delta[hi + 1] -= size
        out, running = [], 0
        for i in range(n):
            running += delta[i]
            out.append(running)
        return out

    def peak_bytes_without_offload(self) -> int:
        return max(self.resident_bytes_without_offload(), default=0)

    def total_duration_ms(self) -> float:
        return sum(op.duration_ms for op in self.ops)

    # --- JSON -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "ops": [
                {
                    "name": op.name,
                    "duration_ms": op.duration_ms,
                    "accesses": [[a.storage_id, a.kind.value] for a in op.accesses],
                }
                for op in self.ops
            ],
            "storage_sizes": {str(k): v for k, v in self.storage_sizes.items()},
            "retained_sids": sorted(self.retained_sids),
            "pinned_sids": sorted(self.pinned_sids),
            "death_ops": [[sid, op] for sid, op in sorted(self.death_ops.items())],
            "tail_sids": sorted(self.tail_sids),
            "reserve_retained": self.reserve_retained,
            "memory_limit_bytes": self.memory_limit_bytes,
            "d2h_bandwidth_gbps": self.d2h_bandwidth_gbps,
            "h2d_bandwidth_gbps": self.h2d_bandwidth_gbps,
            "guides": [g.to_dict() for g in self.guides],
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str = "trace") -> ActivationTrace:
        raw_sizes = json_field(doc, "storage_sizes", dict, where)
        sizes: dict[int, int] = {}
        for key, value in raw_sizes.items():
            try:
                sid = int(key)
            except ValueError as exc:
                raise IRFormatError(f"{where}: storage_sizes key {key!r} is not an integer") from exc
            sizes[sid] = non_negative_int(value, f"{where}: storage_sizes[{key}]")
        ops: list[TraceOp] = []
        for i, raw in enumerate(json_field(doc, "ops", list, where)):
            w = f"{where}: ops[{i}]"
            if not isinstance(raw, dict):
                raise IRFormatError(f"{w}: expected an object, got {raw!r}")
            accesses = []
            for j, pair in enumerate(json_field(raw, "accesses", list, w)):
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise IRFormatError(f"{w}.accesses[{j}]: expected [sid, kind], got {pair!r}")
                sid = non_negative_int(pair[0], f"{w}.accesses[{j}] sid")
                if sid not in sizes:
                    raise IRFormatError(f"{w}.accesses[{j}]: storage {sid} has no size")
                try:
                    kind = AccessKind(pair[1])
                except ValueError as exc:
                    raise IRFormatError(f"{w}.accesses[{j}]: unknown kind {pair[1]!r}") from exc
                accesses.append(StorageAccess(i, sid, kind))
            ops.append(
                TraceOp(
                    name=json_field(raw, "name", str, w),
                    duration_ms=non_negative_float(
                        json_field(raw, "duration_ms", (int, float), w), f"{w}.duration_ms"
                    ),
                    accesses=tuple(accesses),
                )
            )
        retained = frozenset(
            non_negative_int(s, f"{where}: retained_sids")
            for s in json_field(doc, "retained_sids", list, where)
        )
        raw_pinned = doc.get("pinned_sids", [])
        if not isinstance(raw_pinned, list):
            raise IRFormatError(f"{where}: pinned_sids must be a list, got {raw_pinned!r}")
        pinned = frozenset(non_negative_int(s, f"{where}: pinned_sids") for s in raw_pinned)
        raw_deaths = doc.get("death_ops", [])
        if not isinstance(raw_deaths, list) or not all(isinstance(p, list) and len(p) == 2
                                                       for p in raw_deaths):
            raise IRFormatError(f"{where}: death_ops must be a list of [sid, op] pairs, got {raw_deaths!r}")
        deaths = {non_negative_int(p[0], f"{where}: death_ops sid"):
                  non_negative_int(p[1], f"{where}: death_ops op") for p in raw_deaths}
        raw_tails = doc.get("tail_sids", [])
        if not isinstance(raw_tails, list):
            raise IRFormatError(f"{where}: tail_sids must be a list, got {raw_tails!r}")
        tails = frozenset(non_negative_int(s, f"{where}: tail_sids") for s in raw_tails)
        reserve = doc.get("reserve_retained", False)
        if not isinstance(reserve, bool):
            raise IRFormatError(f"{where}: reserve_retained must be a bool, got {reserve!r}")
        guides = [
            OpGuide.from_dict(g, f"{where}: guides[{i}]")
            for i, g in enumerate(doc.get("guides", []) or [])
        ]
        if guides and len(guides) != len(ops):
            raise IRFormatError(f"{where}: {len(guides)} guides for {len(ops)} ops")
        return cls(
            ops=ops,
            storage_sizes=sizes,
            retained_sids=retained,
            memory_limit_bytes=non_negative_int(
                json_field(doc, "memory_limit_bytes", int, where), f"{where}: memory_limit_bytes"
            ),
            d2h_bandwidth_gbps=non_negative_float(
                json_field(doc, "d2h_bandwidth_gbps", (int, float), where), f"{where}: d2h"
            ),
            h2d_bandwidth_gbps=non_negative_float(
                json_field(doc, "h2d_bandwidth_gbps", (int, float), where), f"{where}: h2d"
            ),
            guides=guides,
            pinned_sids=pinned,
            death_ops=deaths,
            tail_sids=tails,
            reserve_retained=reserve,
        )

    def save(self, path: str | Path) -> None:
        write_json(path, "trace", self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> ActivationTrace:
        return cls.from_dict(read_json(path, "trace"), where=str(path))
