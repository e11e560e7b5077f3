"""The schedule compiled for replay: per-op tuples, precomputed so the hot path only compares.

Replay binds every activation the trace saw (to check each op's inputs are the storages
the plan expects) but acts only on the storages the schedule moves: only those get a
residency entry, actions and page-in checks.
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
    in_sids: tuple[tuple[int, ...] | None, ...]  # per tensor input: sid, or NOT_ACTIVATION/NO_STORAGE
    in_moved: tuple[tuple[int, ...] | None, ...]  # moved sids the op reads or writes
    binds: tuple[tuple[tuple[int, int, bool], ...] | None, ...]  # (leaf, sid, moved) of new storages
    writes: tuple[tuple[int, ...] | None, ...]  # moved sids each op writes
    region_accesses: tuple[dict[int, AccessKind] | None, ...]  # opaque ops: every sid they touch
    meta: tuple[tuple[LeafCheck, ...], ...]
    planned_resident: tuple[int, ...]  # the schedule's resident bytes per op (simulated)
    prefix: tuple[int, ...]  # prefix[i]: a hash of ops 0..i as replay checks them
    moved: frozenset[int]
    pinned: frozenset[int]
    num_sids: int
    trace: ActivationTrace  # a diverged replay takes its ops before the divergence from here

    @property
    def num_ops(self) -> int:
        return len(self.keys)

    @classmethod
    def build(cls, trace: ActivationTrace, schedule: ResidencySchedule, keys: list[Any],
              planned_resident: list[int] | None = None) -> ReplayProgram:
        n = trace.num_ops
        if schedule.num_ops != n or len(trace.guides) != n or len(keys) != n:
            raise ValueError(
                f"schedule has {schedule.num_ops} op slots, trace {n} ops, {len(trace.guides)} guides "
                f"and {len(keys)} keys; they must agree"
            )
        moved = schedule.moved_sids() - trace.pinned_sids
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

        in_sids, in_moved, binds, writes, regions, meta = [], [], [], [], [], []
        for op, guide, key in zip(trace.ops, trace.guides, keys, strict=True):
            opaque = isinstance(key, str)
            in_sids.append(None if opaque else tuple(guide.input_sids))
            touched = tuple(a.storage_id for a in op.accesses if a.storage_id in moved)
            in_moved.append(touched or None)
            b = tuple((leaf, sid, sid in moved) for leaf, sid in sorted(guide.output_bindings.items()))
            binds.append(b or None)
            w = tuple(a.storage_id for a in op.accesses
                      if a.kind is AccessKind.WRITE and a.storage_id in moved)
            writes.append(w or None)
            regions.append({a.storage_id: a.kind for a in op.accesses} if opaque else None)
            meta.append(tuple(None if m is None else (tuple(m[0]), _dtype(m[1])) for m in guide.output_meta))
        if planned_resident is None:
            planned_resident = trace.resident_bytes_without_offload()
        prefix, h = [], 0
        for i in range(n):
            region = regions[i]
            h = hash((h, keys[i], in_sids[i], tuple((leaf, sid) for leaf, sid, _ in binds[i] or ()),
                      meta[i], None if region is None else tuple(sorted(region.items()))))
            prefix.append(h)
        return cls(
            keys=tuple(keys),
            names=tuple(op.name for op in trace.ops),
            pre=tuple(compile_actions(a, i, False) for i, a in enumerate(schedule.pre)),
            post=tuple(compile_actions(a, i, True) for i, a in enumerate(schedule.post)),
            in_sids=tuple(in_sids),
            in_moved=tuple(in_moved),
            binds=tuple(binds),
            writes=tuple(writes),
            region_accesses=tuple(regions),
            meta=tuple(meta),
            planned_resident=tuple(planned_resident),
            prefix=tuple(prefix),
            moved=moved,
            pinned=trace.pinned_sids,
            num_sids=max(trace.storage_sizes, default=-1) + 1,
            trace=trace,
        )
