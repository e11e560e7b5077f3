"""The schedule compiled for replay: per-op tuples, only for storages the schedule moves.

A storage the schedule never copies to host needs no binding and no action at replay
(its device memory is freed by Python as usual), so it costs nothing per op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hyperpar.offload.ir import AccessKind, ActivationTrace, ResidencyAction, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as A

D2H, RELEASE, RELEASE_FINAL, H2D, RELEASE_HOST = range(5)

Actions = tuple[tuple[int, int], ...] | None
LeafCheck = tuple[tuple[int, ...], torch.dtype] | None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the trace's output_meta")
    return dtype


@dataclass(frozen=True)
class ReplayProgram:
    keys: tuple[Any, ...]  # OpOverload (compared by identity) or an opaque region's name
    names: tuple[str, ...]
    pre: tuple[Actions, ...]
    post: tuple[Actions, ...]
    binds: tuple[tuple[tuple[int, int], ...] | None, ...]  # (leaf index, sid) of moved storages
    writes: tuple[tuple[int, ...] | None, ...]  # moved sids each op writes
    meta: tuple[tuple[LeafCheck, ...], ...]
    base_resident: tuple[int, ...]  # the trace's resident bytes per op without offload
    moved: frozenset[int]

    @property
    def num_ops(self) -> int:
        return len(self.keys)

    @classmethod
    def build(cls, trace: ActivationTrace, schedule: ResidencySchedule, keys: list[Any]) -> ReplayProgram:
        n = trace.num_ops
        if schedule.num_ops != n or len(trace.guides) != n or len(keys) != n:
            raise ValueError(
                f"schedule has {schedule.num_ops} op slots, trace {n} ops, {len(trace.guides)} guides "
                f"and {len(keys)} keys; they must agree"
            )
        moved = schedule.moved_sids()
        last_access: dict[int, int] = {}
        for i, op in enumerate(trace.ops):
            for acc in op.accesses:
                last_access[acc.storage_id] = i

        def compile_actions(acts: list[ResidencyAction], i: int, post: bool) -> Actions:
            out = []
            for a in acts:
                sid = a.storage_id
                if sid not in moved:
                    continue
                if a.kind is A.COPY_D2H:
                    out.append((D2H, sid))
                elif a.kind is A.COPY_H2D:
                    out.append((H2D, sid))
                elif a.kind is A.RELEASE_HOST:
                    out.append((RELEASE_HOST, sid))
                else:
                    last = last_access.get(sid, -1)
                    final = sid not in trace.retained_sids and (i >= last if post else i > last)
                    out.append((RELEASE_FINAL if final else RELEASE, sid))
            return tuple(out) or None

        binds, writes, meta = [], [], []
        for op, guide in zip(trace.ops, trace.guides, strict=True):
            b = tuple((leaf, sid) for leaf, sid in sorted(guide.output_bindings.items()) if sid in moved)
            binds.append(b or None)
            w = tuple(a.storage_id for a in op.accesses
                      if a.kind is AccessKind.WRITE and a.storage_id in moved)
            writes.append(w or None)
            meta.append(tuple(None if m is None else (tuple(m[0]), _dtype(m[1])) for m in guide.output_meta))
        return cls(
            keys=tuple(keys),
            names=tuple(op.name for op in trace.ops),
            pre=tuple(compile_actions(a, i, False) for i, a in enumerate(schedule.pre)),
            post=tuple(compile_actions(a, i, True) for i, a in enumerate(schedule.post)),
            binds=tuple(binds),
            writes=tuple(writes),
            meta=tuple(meta),
            base_resident=tuple(trace.resident_bytes_without_offload()),
            moved=moved,
        )
