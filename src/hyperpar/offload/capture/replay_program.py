"""The schedule compiled for replay: per-op columns, precomputed so the hot path only compares.

Replay binds every activation the trace saw (to check each op's inputs are the storages
the plan expects) but acts only on the storages the schedule moves: only those get a
residency entry, actions and page-in checks.

A program has two parts. The *structure* (op keys, which storage each input is, which
outputs are new storages, output dtypes and ranks) is what replay checks; it does not
depend on sizes, so steps with another sequence length or batch size follow the same
structure. The *schedule* part (actions, moved storages, planned resident bytes) is
planned for one set of sizes; programs for other sizes share the structure's columns.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, replace
from typing import Any

import torch

from hyperpar.offload.ir import AccessKind, ActivationTrace, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as A
from hyperpar.offload.ir.packed import PackedTrace

D2H, RELEASE, RELEASE_FINAL, H2D, RELEASE_HOST = range(5)
READ, WRITE = AccessKind.READ, AccessKind.WRITE
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


# ``ReplayProgram.flags`` bits: which of an op's columns hold anything
HAS_PRE, HAS_POST, HAS_MOVED, HAS_WRITES = 1, 2, 4, 8


@dataclass(frozen=True, eq=False)
class ReplayProgram:
    """Per-op columns as flat arrays (a tuple per op and field cost hundreds of bytes an op):
    a ragged column ``x`` holds op ``i``'s entries at ``x_sid[x_start[i]:x_start[i+1]]``."""

    # --- the structure (shared by the programs of one structure) ---
    keys: tuple[Any, ...]  # OpOverload (compared by identity) or an opaque region's name
    names: tuple[str, ...]
    in_start: array  # per tensor input: sid, or NOT_ACTIVATION/NO_STORAGE (ragged; none for opaque ops)
    in_sid: array
    bind_start: array  # (leaf, sid) of the new storages, by leaf (ragged)
    bind_leaf: array
    bind_sid: array
    region_accesses: dict[int, dict[int, AccessKind]]  # opaque ops: every sid they touch
    meta: tuple[tuple[LeafCheck, ...], ...]  # one shared tuple per distinct meta
    prefix: array  # prefix[i]: a hash of ops 0..i as replay checks them
    pinned: frozenset[int]
    num_sids: int
    # --- the schedule, for one set of sizes ---
    flags: bytes  # HAS_* bits per op
    act_start: array  # op i's pre actions at [act_start[2i], act_start[2i+1]), post up to act_start[2i+2]
    act_code: bytes  # D2H, RELEASE, ...
    act_sid: array
    moved_start: array  # moved sids the op reads or writes (ragged)
    moved_sid: array
    write_start: array  # moved sids each op writes (ragged)
    write_sid: array
    planned_resident: array  # the schedule's resident bytes per op (simulated)
    made: array  # bytes of the new storages each op makes, at the planned sizes
    moved: frozenset[int]
    bucket: int  # size_bucket of the first activation's size this program was planned for
    packed: PackedTrace  # a diverged replay takes its ops before the divergence from here

    @property
    def num_ops(self) -> int:
        return len(self.keys)

    @property
    def structure(self) -> int:
        return self.prefix[-1] if self.prefix else 0

    def inputs(self, i: int) -> array | None:
        """Op ``i``'s expected input sids (None for an opaque region)."""
        return None if isinstance(self.keys[i], str) else self.in_sid[self.in_start[i]:self.in_start[i + 1]]

    def binds(self, i: int) -> tuple[tuple[int, int], ...] | None:
        lo, hi = self.bind_start[i], self.bind_start[i + 1]
        return tuple(zip(self.bind_leaf[lo:hi], self.bind_sid[lo:hi], strict=True)) or None

    def in_moved(self, i: int) -> array:
        return self.moved_sid[self.moved_start[i]:self.moved_start[i + 1]]

    def writes(self, i: int) -> array:
        return self.write_sid[self.write_start[i]:self.write_start[i + 1]]

    def actions(self, j: int) -> list[tuple[int, int]]:
        """(code, sid) of list ``j``: op i's pre list is ``2i``, its post list ``2i+1``."""
        lo, hi = self.act_start[j], self.act_start[j + 1]
        return list(zip(self.act_code[lo:hi], self.act_sid[lo:hi], strict=True))

    @classmethod
    def build(cls, trace: ActivationTrace, schedule: ResidencySchedule, keys: list[Any],
              planned_resident: list[int] | None = None,
              structure: ReplayProgram | None = None, packed: PackedTrace | None = None) -> ReplayProgram:
        """``structure``: a program of the same structure whose structure columns to share;
        ``packed``: the trace packed (packed here when not given)."""
        n = trace.num_ops
        if schedule.num_ops != n or len(trace.guides) != n or len(keys) != n:
            raise ValueError(
                f"schedule has {schedule.num_ops} op slots, trace {n} ops, {len(trace.guides)} guides "
                f"and {len(keys)} keys; they must agree"
            )
        if packed is None:
            packed = PackedTrace(trace)
        st = packed.structure
        moved = schedule.moved_sids() - trace.pinned_sids
        last_access: dict[int, int] = {}
        acc_start, acc_sid, acc_write = st.access_start, st.access_sid, st.access_write
        for i in range(n):
            for k in range(acc_start[i], acc_start[i + 1]):
                last_access[acc_sid[k]] = i
        retained = trace.retained_sids
        flags = bytearray(n)
        act_start, act_code, act_sid = array("i", [0]), bytearray(), array("q")
        copy_d2h, copy_h2d, release_host = A.COPY_D2H, A.COPY_H2D, A.RELEASE_HOST
        for i, (pre, post) in enumerate(zip(schedule.pre, schedule.post, strict=True)):
            for acts, is_post, bit in ((pre, False, HAS_PRE), (post, True, HAS_POST)):
                for a in acts:
                    sid = a.storage_id
                    if sid not in moved:
                        continue
                    kind = a.kind
                    if kind is copy_d2h:
                        code = D2H
                    elif kind is copy_h2d:
                        code = H2D
                    elif kind is release_host:
                        code = RELEASE_HOST
                    else:
                        last = last_access.get(sid, -1)
                        final = sid not in retained and (i >= last if is_post else i > last)
                        code = RELEASE_FINAL if final else RELEASE
                    act_code.append(code)
                    act_sid.append(sid)
                if len(act_sid) != act_start[-1]:
                    flags[i] |= bit
                act_start.append(len(act_sid))
        moved_start, moved_sid = array("i", [0]), array("q")
        write_start, write_sid = array("i", [0]), array("q")
        if moved:
            for i in range(n):
                for k in range(acc_start[i], acc_start[i + 1]):
                    sid = acc_sid[k]
                    if sid in moved:
                        moved_sid.append(sid)
                        if acc_write[k]:
                            write_sid.append(sid)
                if len(moved_sid) != moved_start[-1]:
                    flags[i] |= HAS_MOVED
                if len(write_sid) != write_start[-1]:
                    flags[i] |= HAS_WRITES
                moved_start.append(len(moved_sid))
                write_start.append(len(write_sid))
        else:
            moved_start = write_start = array("i", bytes(4 * (n + 1)))
        if planned_resident is None:
            planned_resident = trace.resident_bytes_without_offload()
        base = structure if structure is not None else _structure(trace, keys, packed)
        sizes = trace.storage_sizes
        made = array("q", bytes(8 * n))
        bind_start, bind_sid = base.bind_start, base.bind_sid
        for i in range(n):
            lo, hi = bind_start[i], bind_start[i + 1]
            if lo != hi:
                made[i] = sum(sizes.get(sid, 0) for sid in bind_sid[lo:hi])
        return replace(
            base,
            flags=bytes(flags), act_start=act_start, act_code=bytes(act_code), act_sid=act_sid,
            moved_start=moved_start, moved_sid=moved_sid, write_start=write_start, write_sid=write_sid,
            planned_resident=array("q", planned_resident),
            made=made,
            moved=moved,
            bucket=size_bucket(sizes.get(0, 0)),
            packed=packed,
        )


def _structure(trace: ActivationTrace, keys: list[Any], packed: PackedTrace) -> ReplayProgram:
    st = packed.structure  # build() checked there is a guide per op
    metas = tuple(tuple(None if lm is None else (len(lm[0]), _dtype(lm[1])) for lm in m) for m in st.metas)
    meta = tuple(metas[j] for j in st.meta_index)
    regions: dict[int, dict[int, AccessKind]] = {}
    prefix = array("q", bytes(8 * len(keys)))
    h = 0
    in_start, in_sid, bind_start = st.input_start, st.input_sid, st.bind_start
    bind_leaf, bind_sid = st.bind_leaf, st.bind_sid
    for i, key in enumerate(keys):
        opaque = isinstance(key, str)
        ins = None if opaque else tuple(in_sid[in_start[i]:in_start[i + 1]])
        lo, hi = bind_start[i], bind_start[i + 1]
        b = tuple(zip(bind_leaf[lo:hi], bind_sid[lo:hi], strict=True)) or None
        region = None
        if opaque:
            region = regions[i] = {s: WRITE if w else READ for s, w in st.accesses(i)}
        h = hash((h, key, ins, b, meta[i], None if region is None else tuple(sorted(region.items()))))
        prefix[i] = h
    return ReplayProgram(
        keys=tuple(keys), names=st.names, in_start=in_start, in_sid=in_sid,
        bind_start=bind_start, bind_leaf=bind_leaf, bind_sid=bind_sid, region_accesses=regions,
        meta=meta, prefix=prefix, pinned=trace.pinned_sids, num_sids=max(trace.storage_sizes, default=-1) + 1,
        flags=b"", act_start=array("i"), act_code=b"", act_sid=array("q"), moved_start=array("i"),
        moved_sid=array("q"), write_start=array("i"), write_sid=array("q"), planned_resident=array("q"),
        made=array("q"), moved=frozenset(), bucket=0, packed=packed,
    )
