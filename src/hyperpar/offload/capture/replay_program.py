"""The schedule compiled for replay: per-op tuples, precomputed so the hot path only compares.

Replay binds every activation the trace saw (to check each op's inputs are the storages
the plan expects) but acts only on the storages the schedule moves: only those get a
residency entry, actions and page-in checks.

A program has two parts. The *structure* (op keys, which storage each input is, which
outputs are new storages, output dtypes and ranks) is what replay checks; it does not
depend on sizes, so steps with another sequence length or batch size follow the same
structure. The *schedule* part (actions, moved storages, planned resident bytes) is
planned for one set of sizes; programs for other sizes share the structure's tuples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from hyperpar.offload.ir import AccessKind, ActivationTrace, ResidencyAction, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as A
from hyperpar.offload.ir.packed import PackedTrace

D2H, RELEASE, RELEASE_FINAL, H2D, RELEASE_HOST = range(5)

Actions = tuple[tuple[int, int], ...] | None
LeafCheck = tuple[int, torch.dtype] | None  # (ndim, dtype) of a tensor leaf


_DTYPES: dict[str, torch.dtype] = {}


def _dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = getattr(torch, name.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {name!r} in the trace's output_meta")
        _DTYPES[name] = dtype
    return dtype


def size_bucket(nbytes: int) -> int:
    """Sizes within about 19 % of each other share a bucket (four buckets per doubling)."""
    return round(4 * math.log2(max(nbytes, 1)))


@dataclass(frozen=True)
class ReplayProgram:
    # --- the structure (shared by the programs of one structure) ---
    keys: tuple[Any, ...]  # OpOverload (compared by identity) or an opaque region's name
    names: tuple[str, ...]
    in_sids: tuple[tuple[int, ...] | None, ...]  # per tensor input: sid, or NOT_ACTIVATION/NO_STORAGE
    binds: tuple[tuple[tuple[int, int], ...] | None, ...]  # (leaf, sid) of the new storages
    region_accesses: tuple[dict[int, AccessKind] | None, ...]  # opaque ops: every sid they touch
    meta: tuple[tuple[LeafCheck, ...], ...]
    prefix: tuple[int, ...]  # prefix[i]: a hash of ops 0..i as replay checks them
    pinned: frozenset[int]
    num_sids: int
    # --- the schedule, for one set of sizes ---
    pre: tuple[Actions, ...]
    post: tuple[Actions, ...]
    in_moved: tuple[tuple[int, ...] | None, ...]  # moved sids the op reads or writes
    writes: tuple[tuple[int, ...] | None, ...]  # moved sids each op writes
    planned_resident: tuple[int, ...]  # the schedule's resident bytes per op (simulated)
    made: tuple[int, ...]  # bytes of the new storages each op makes, at the planned sizes
    moved: frozenset[int]
    bucket: int  # size_bucket of the first activation's size this program was planned for
    packed: PackedTrace  # a diverged replay takes its ops before the divergence from here

    @property
    def num_ops(self) -> int:
        return len(self.keys)

    @property
    def structure(self) -> int:
        return self.prefix[-1] if self.prefix else 0

    @classmethod
    def build(cls, trace: ActivationTrace, schedule: ResidencySchedule, keys: list[Any],
              planned_resident: list[int] | None = None,
              structure: ReplayProgram | None = None, packed: PackedTrace | None = None) -> ReplayProgram:
        """``structure``: a program of the same structure whose structure tuples to share;
        ``packed``: the trace packed (packed here when not given)."""
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

        in_moved, writes = [], []
        for op in trace.ops:
            touched = tuple(a.storage_id for a in op.accesses if a.storage_id in moved)
            in_moved.append(touched or None)
            w = tuple(a.storage_id for a in op.accesses
                      if a.kind is AccessKind.WRITE and a.storage_id in moved)
            writes.append(w or None)
        if planned_resident is None:
            planned_resident = trace.resident_bytes_without_offload()
        if packed is None:
            packed = PackedTrace(trace)
        base = structure if structure is not None else _structure(trace, keys, packed)
        return replace(
            base,
            pre=tuple(compile_actions(a, i, False) for i, a in enumerate(schedule.pre)),
            post=tuple(compile_actions(a, i, True) for i, a in enumerate(schedule.post)),
            in_moved=tuple(in_moved),
            writes=tuple(writes),
            planned_resident=tuple(planned_resident),
            made=tuple(sum(trace.storage_sizes.get(sid, 0) for _, sid in b) if b else 0 for b in base.binds),
            moved=moved,
            bucket=size_bucket(trace.storage_sizes.get(0, 0)),
            packed=packed,
        )


def _structure(trace: ActivationTrace, keys: list[Any], packed: PackedTrace) -> ReplayProgram:
    in_sids, binds, regions, meta, prefix = [], [], [], [], []
    h = 0
    for op, guide, key in zip(trace.ops, trace.guides, keys, strict=True):
        opaque = isinstance(key, str)
        ins = None if opaque else tuple(guide.input_sids)
        b = tuple(sorted(guide.output_bindings.items())) or None
        region = {a.storage_id: a.kind for a in op.accesses} if opaque else None
        m = tuple(None if lm is None else (len(lm[0]), _dtype(lm[1])) for lm in guide.output_meta)
        h = hash((h, key, ins, b, m, None if region is None else tuple(sorted(region.items()))))
        in_sids.append(ins)
        binds.append(b)
        regions.append(region)
        meta.append(m)
        prefix.append(h)
    return ReplayProgram(
        keys=tuple(keys), names=tuple(op.name for op in trace.ops), in_sids=tuple(in_sids),
        binds=tuple(binds), region_accesses=tuple(regions), meta=tuple(meta), prefix=tuple(prefix),
        pinned=trace.pinned_sids, num_sids=max(trace.storage_sizes, default=-1) + 1,
        pre=(), post=(), in_moved=(), writes=(), planned_resident=(), made=(), moved=frozenset(), bucket=0,
        packed=packed,
    )
