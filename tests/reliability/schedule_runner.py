"""Run a planner's schedule for a trace on the real ResidencyManager, with random bytes.

Each storage of the trace becomes a real uint8 CPU tensor of its size, created at its first
access and dropped (as Python would free it) after its last one unless retained. Every
READ checks the bytes against what the last WRITE put there; every WRITE puts fresh random
bytes. Actions map to the manager as replay maps them, and an op waits as replay's does
(frees reaped, in-flight copies in waited on, copies out of a storage it writes finished),
so the asynchronous engine is exercised too. Returns the resident bytes the manager counted
while each op ran.
"""

from __future__ import annotations

import torch

from hyperpar.offload.ir import AccessKind, ActivationTrace, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.runtime import HostPool, ResidencyManager, make_copy_engine


class DataLost(AssertionError):
    """A storage came back with other bytes than it had, or was not there when read."""


def _last_access(trace: ActivationTrace) -> dict[int, int]:
    last: dict[int, int] = {}
    for i, op in enumerate(trace.ops):
        for acc in op.accesses:
            last[acc.storage_id] = i
    return last


def run_schedule(trace: ActivationTrace, schedule: ResidencySchedule, manager: ResidencyManager,
                 gen: torch.Generator) -> list[int]:
    last = _last_access(trace)
    tensors: dict[int, torch.Tensor] = {}
    expected: dict[int, torch.Tensor] = {}
    resident: list[int] = []

    def apply(i: int, post: bool, kind: Act, sid: int) -> None:
        t = tensors.get(sid)
        if t is None:
            return  # not created yet or already freed: nothing on the device to act on
        entry = manager.lookup(t.untyped_storage())
        assert entry is not None, f"op {i}: storage {sid} is not bound"
        if kind is Act.COPY_D2H:
            manager.copy_d2h(entry)
        elif kind is Act.COPY_H2D:
            manager.copy_h2d(entry)
        elif kind is Act.RELEASE_HOST:
            manager.release_host(entry)
        else:
            final = sid not in trace.retained_sids and (i >= last[sid] if post else i > last[sid])
            manager.release_device(entry, final=final)

    for i, op in enumerate(trace.ops):
        for action in schedule.pre[i]:
            apply(i, False, action.kind, action.storage_id)
        for acc in op.accesses:
            sid, size = acc.storage_id, trace.storage_sizes[acc.storage_id]
            t = tensors.get(sid)
            if t is None:
                if acc.kind is not AccessKind.WRITE:
                    raise DataLost(f"op {i} reads storage {sid} before any write")
                t = tensors[sid] = torch.empty(size, dtype=torch.uint8)
                manager.bind(sid, t.untyped_storage(), producer_op=i)
            entry = manager.lookup(t.untyped_storage())
            if manager.pending_free:
                manager.reap()
            if entry is None or not entry.resident or t.untyped_storage().nbytes() != size:
                raise DataLost(f"op {i} ({op.name}) accesses storage {sid}, which is not resident")
            manager.wait_h2d(entry)
            if acc.kind is AccessKind.WRITE:
                manager.wait_d2h(entry)
            if acc.kind is AccessKind.READ and not torch.equal(t, expected[sid]):
                raise DataLost(f"op {i} ({op.name}) reads storage {sid} with other bytes than written")
        t = None  # hold no reference past the loop: a storage must die when its last user drops it
        resident.append(manager.resident_bytes)
        for acc in op.accesses:
            if acc.kind is AccessKind.WRITE:
                sid = acc.storage_id
                fresh = torch.randint(0, 256, (trace.storage_sizes[sid],), dtype=torch.uint8, generator=gen)
                tensors[sid].copy_(fresh)
                expected[sid] = fresh
                manager.mark_written(manager.lookup(tensors[sid].untyped_storage()))
        for action in schedule.post[i]:
            apply(i, True, action.kind, action.storage_id)
        for acc in op.accesses:
            sid = acc.storage_id
            if last[sid] == i and sid not in trace.retained_sids:
                del tensors[sid]  # freed like an activation nobody references any more
    manager.restore_all()
    manager.wait_all()
    for sid in trace.retained_sids:
        if sid in tensors and not torch.equal(tensors[sid], expected[sid]):
            raise DataLost(f"retained storage {sid} has other bytes at the end of the step")
    tensors.clear()
    return resident


def fresh_manager(cap_bytes: int = 1 << 40, engine: str = "sync") -> ResidencyManager:
    cpu = torch.device("cpu")
    return ResidencyManager(cpu, HostPool(cap_bytes), make_copy_engine(cpu, engine))
