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

import numpy as np
import torch
from torch._ops import OpOverload

from hyperpar.offload.capture.checked.prefix_hash import prefix_hashes
from hyperpar.offload.capture.ops.op_args import nested_tensors
from hyperpar.offload.ir import AccessKind, ActivationTrace, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as A
from hyperpar.offload.ir.packed import PackedTrace
from hyperpar.offload.ir.packed_schedule import KINDS, PackedSchedule
from hyperpar.offload.ir.sorted_ids import sorted_distinct

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
SCHEDULED = HAS_PRE | HAS_POST | HAS_MOVED | HAS_WRITES
# the op's schema lets a tensor come in a list or as a keyword argument: replay checks its
# inputs the general way (``op_args.nested_tensors``)
NESTED_INPUTS = 16
BINDS = 32  # the op makes new storages (bind_start says which)
BINDS_OTHER = 64  # ... and not just one, its first output leaf
# a storage the schedule moves died in the op before: let go of finished copies first (the
# thread engine keeps a copy's tensors until the compute thread polls it, which would keep
# that storage on the device past the death the plan counts on)
AFTER_DEATH = 128
# replay's lean path takes an op none of these bits is set for (see ``ReplayExecutor.run_op``)
NOT_LEAN = NESTED_INPUTS | SCHEDULED | BINDS_OTHER | AFTER_DEATH


@dataclass(frozen=True, eq=False)
class ReplayProgram:
    """Per-op columns as flat arrays (a tuple per op and field cost hundreds of bytes an op):
    a ragged column ``x`` holds op ``i``'s entries at ``x_sid[x_start[i]:x_start[i+1]]``."""

    # --- the structure (shared by the programs of one structure) ---
    keys: tuple[Any, ...]  # OpOverload (compared by identity) or an opaque region's name
    calls: tuple[Any, ...]  # what calling each key calls (``OpOverload._op``: one Python frame less)
    names: tuple[str, ...]
    in_start: array  # per tensor input: sid, or NOT_ACTIVATION/NO_STORAGE (ragged; none for opaque ops)
    in_sid: array
    bind_start: array  # (leaf, sid) of the new storages, by leaf (ragged)
    bind_leaf: array
    bind_sid: array
    structure_flags: bytes  # per op: NESTED_INPUTS, BINDS, BINDS_OTHER (flags adds the schedule's)
    region_accesses: dict[int, dict[int, AccessKind]]  # opaque ops: every sid they touch
    meta: tuple[tuple[LeafCheck, ...], ...]  # one shared tuple per distinct meta
    # an op whose output is one tensor: its dtype (else None) and rank (replay's lean check)
    out_dtype: tuple[torch.dtype | None, ...]
    out_ndim: bytes
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
    planned_peak: int  # max(planned_resident), read at every step
    made: array  # bytes of the new storages each op makes, at the planned sizes
    moved: frozenset[int]
    bucket: int  # size_bucket of the first activation's size this program was planned for
    packed: PackedTrace  # a diverged replay takes its ops before the divergence from here
    # the budget floor at the planned sizes (instant copies): when the budget is above it,
    # replay holds the budget itself, whatever peak copy timing gave the timed plan
    floor_bytes: int = 0

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
              structure: ReplayProgram | None = None, packed: PackedTrace | None = None,
              packed_schedule: PackedSchedule | None = None, floor_bytes: int = 0) -> ReplayProgram:
        """``structure``: a program of the same structure whose structure columns to share;
        ``packed``, ``packed_schedule``: the trace and schedule packed (packed here when not given)."""
        n = trace.num_ops
        if schedule.num_ops != n or len(trace.guides) != n or len(keys) != n:
            raise ValueError(
                f"schedule has {schedule.num_ops} op slots, trace {n} ops, {len(trace.guides)} guides "
                f"and {len(keys)} keys; they must agree"
            )
        if packed is None:
            packed = PackedTrace(trace)
        if packed_schedule is None:
            packed_schedule = PackedSchedule(schedule)
        base = structure if structure is not None else _structure(trace, keys, packed)
        st = packed.structure
        all_sids, kinds = _np(packed_schedule.sid), np.frombuffer(packed_schedule.kind, dtype=np.uint8)
        copied = sorted_distinct(all_sids[kinds == _COPY_D2H])  # schedule.moved_sids(), from the arrays
        if trace.pinned_sids:
            copied = copied[~np.isin(copied, np.fromiter(trace.pinned_sids, dtype=np.int64))]
        moved = frozenset(copied.tolist())
        moved_ids = copied
        ops = np.arange(n, dtype=np.int64)
        acc_sid = _np(st.access_sid)
        acc_op = np.repeat(ops, np.diff(_np(st.access_start)))
        acc_write = np.frombuffer(st.access_write, dtype=np.uint8).astype(bool)
        # the actions on moved storages, compiled (a release after the last access is final)
        lists = np.repeat(np.arange(2 * n, dtype=np.int64), np.diff(_np(packed_schedule.start)))
        act_sid, kind = all_sids, kinds
        keep = np.isin(act_sid, moved_ids)
        lists, act_sid, kind = lists[keep], act_sid[keep], kind[keep]
        last = np.full(len(act_sid), -1, dtype=np.int64)
        if len(acc_sid) and len(act_sid):
            sids = sorted_distinct(acc_sid)
            last_of = np.full(len(sids), -1, dtype=np.int64)
            np.maximum.at(last_of, np.searchsorted(sids, acc_sid), acc_op)
            where = np.minimum(np.searchsorted(sids, act_sid), len(sids) - 1)
            last = np.where(sids[where] == act_sid, last_of[where], -1)
        op, is_post = lists // 2, (lists % 2).astype(bool)
        final = ~np.isin(act_sid, np.fromiter(trace.retained_sids, dtype=np.int64)) & np.where(
            is_post, op >= last, op > last)
        code = _CODES[kind]
        code[(kind == _RELEASE_DEVICE) & final] = RELEASE_FINAL
        per_list = np.bincount(lists, minlength=2 * n)
        # the moved storages each op touches, and those it writes
        touched = np.isin(acc_sid, moved_ids)
        written = touched & acc_write
        per_op_moved = np.bincount(acc_op[touched], minlength=n)
        per_op_written = np.bincount(acc_op[written], minlength=n)
        flags = ((per_list[0::2] > 0) * HAS_PRE | (per_list[1::2] > 0) * HAS_POST
                 | (per_op_moved > 0) * HAS_MOVED | (per_op_written > 0) * HAS_WRITES
                 | np.frombuffer(base.structure_flags, dtype=np.uint8))
        died = [death + 1 for sid, death in trace.death_ops.items() if sid in moved and death + 1 < n]
        if died:
            flags[np.asarray(died, dtype=np.int64)] |= AFTER_DEATH
        # bytes of the new storages each op makes, at these sizes
        bind_sid = _np(base.bind_sid)
        bind_op = np.repeat(ops, np.diff(_np(base.bind_start)))
        made = np.zeros(n, dtype=np.int64)
        np.add.at(made, bind_op, _sizes_of(packed, bind_sid))
        if planned_resident is None:
            planned_resident = trace.resident_bytes_without_offload()
        return replace(
            base,
            flags=np.asarray(flags, dtype=np.uint8).tobytes(), act_start=_offsets(per_list),
            act_code=code.astype(np.uint8).tobytes(), act_sid=_q(act_sid),
            moved_start=_offsets(per_op_moved), moved_sid=_q(acc_sid[touched]),
            write_start=_offsets(per_op_written), write_sid=_q(acc_sid[written]),
            planned_resident=array("q", planned_resident),
            planned_peak=max(planned_resident, default=0),
            floor_bytes=floor_bytes,
            made=_q(made),
            moved=moved,
            bucket=size_bucket(packed.size_of(0)),
            packed=packed,
        )


# PackedSchedule kind (ResidencyActionType order) -> replay code; releases are told apart later
_CODES = np.array([{A.COPY_D2H: D2H, A.COPY_H2D: H2D, A.RELEASE_DEVICE: RELEASE,
                    A.RELEASE_HOST: RELEASE_HOST}[k] for k in KINDS], dtype=np.uint8)
_RELEASE_DEVICE, _COPY_D2H = KINDS.index(A.RELEASE_DEVICE), KINDS.index(A.COPY_D2H)


def _np(a: array) -> np.ndarray:
    return np.array(a, dtype=np.int64)


def _q(a: np.ndarray) -> array:
    out = array("q")
    out.frombytes(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return out


def _offsets(counts: np.ndarray) -> array:
    out = array("i", [0])
    out.frombytes(np.cumsum(counts, dtype=np.int32).tobytes())
    return out


def _sizes_of(packed: PackedTrace, sids: np.ndarray) -> np.ndarray:
    known = _np(packed.size_sid)
    if not len(known) or not len(sids):
        return np.zeros(len(sids), dtype=np.int64)
    order = np.argsort(known, kind="stable")
    known, nbytes = known[order], _np(packed.size_bytes)[order]
    where = np.minimum(np.searchsorted(known, sids), len(known) - 1)
    return np.where(known[where] == sids, nbytes[where], 0)


def _structure(trace: ActivationTrace, keys: list[Any], packed: PackedTrace) -> ReplayProgram:
    st = packed.structure  # build() checked there is a guide per op
    metas = tuple(tuple(None if lm is None else (len(lm[0]), _dtype(lm[1])) for lm in m) for m in st.metas)
    meta = tuple(map(metas.__getitem__, st.meta_index))
    single = [m[0] if len(m) == 1 and m[0] is not None and m[0][0] < 256 else (0, None) for m in metas]
    out_ndim = bytes(single[j][0] for j in st.meta_index)
    out_dtype = tuple(single[j][1] for j in st.meta_index)
    metas_hash = [hash(m) for m in metas]
    regions: dict[int, dict[int, AccessKind]] = {}
    region_hash: dict[int, int] = {}
    opaque = [i for i, key in enumerate(keys) if isinstance(key, str)] if any(
        issubclass(t, str) for t in set(map(type, keys))) else []
    for i in opaque:  # a region is checked on every storage it touches
        region = regions[i] = {s: WRITE if w else READ for s, w in st.accesses(i)}
        region_hash[i] = hash(tuple(sorted(region.items())))
    in_start, in_sid, bind_start = st.input_start, st.input_sid, st.bind_start
    bind_leaf, bind_sid = st.bind_leaf, st.bind_sid
    # by identity: an OpOverload hashes in Python (see ``key_hashes``)
    nested = {id(key): NESTED_INPUTS if isinstance(key, str) or nested_tensors(key) else 0
              for key in dict(zip(map(id, keys), keys, strict=True)).values()}
    starts = _np(bind_start)
    binds = np.diff(starts)
    leaves = _np(bind_leaf)
    first_leaf = leaves[np.minimum(starts[:-1], len(leaves) - 1)] if len(leaves) else binds
    prefix = prefix_hashes(keys, in_start, in_sid, bind_start, bind_leaf, bind_sid,
                           [metas_hash[j] for j in st.meta_index], region_hash)
    return ReplayProgram(
        keys=tuple(keys), calls=tuple(k._op if type(k) is OpOverload else k for k in keys),
        names=st.names, in_start=in_start, in_sid=in_sid,
        bind_start=bind_start, bind_leaf=bind_leaf, bind_sid=bind_sid,
        structure_flags=(np.frombuffer(bytes(map(nested.__getitem__, map(id, keys))), dtype=np.uint8)
                         | (binds > 0) * BINDS
                         | ((binds > 1) | ((binds == 1) & (first_leaf != 0))) * BINDS_OTHER
                         ).astype(np.uint8).tobytes(),
        region_accesses=regions,
        meta=meta, out_dtype=out_dtype, out_ndim=out_ndim,
        prefix=prefix, pinned=trace.pinned_sids, num_sids=max(trace.storage_sizes, default=-1) + 1,
        flags=b"", act_start=array("i"), act_code=b"", act_sid=array("q"), moved_start=array("i"),
        moved_sid=array("q"), write_start=array("i"), write_sid=array("q"), planned_resident=array("q"),
        planned_peak=0,
        made=array("q"), moved=frozenset(), bucket=0, packed=packed,
    )
