"""Rank bodies: the same few SGD steps with FSDP2 or DDP, plain and inside an OffloadSession."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.ir import ResidencyActionType

MIB = 1 << 20
STEPS = 3
# Ops whose buffers belong to the communication library (and, for FSDP2, are freed and
# re-allocated by it with storage.resize_): the plan must never move them.
FOREIGN = ("fsdp.", "c10d.", "_c10d_functional.")


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)]
    return nn.Sequential(*blocks, nn.Linear(32, 8))


def _wrap(kind: str) -> nn.Module:
    model = _model()
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in list(model)[:3]:
            fully_shard(block)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _batch(rank: int, step: int, rows: int = 16) -> torch.Tensor:
    return torch.randn(rows, 32, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(kind: str, rank: int, session: OffloadSession | None, steps: int = STEPS,
           rows: tuple[int, ...] = (16,)) -> tuple[list[torch.Tensor], nn.Module, list[dict[str, Any]]]:
    """``rows``: each step's batch size, in turn."""
    model = _wrap(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, reports = [], []
    for step in range(steps):
        x = _batch(rank, step, rows[step % len(rows)])
        t0 = time.process_time()
        if session is None:
            loss = model(x).square().mean()
            loss.backward()
        else:
            with session:
                loss = model(x).square().mean()
                loss.backward()
            reports.append({"report": session.last_report.as_dict(), "foreign": _foreign_sids(session)})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        if reports:
            reports[-1]["cpu_s"] = time.process_time() - t0
    return losses, model, reports


def _foreign_sids(session: OffloadSession) -> dict[str, int]:
    """FSDP2's and c10d's ops in the current plan, the activation storages they touch, how
    many of those are not pinned and how many the schedule copies to host (both must be 0)."""
    trace, schedule = session.trace, session.schedule
    assert trace is not None and schedule is not None
    ops = [op for op in trace.ops if op.name.startswith(FOREIGN)]
    foreign = {acc.storage_id for op in ops for acc in op.accesses}
    moved = {a.storage_id for _, _, a in schedule.actions() if a.kind is ResidencyActionType.COPY_D2H}
    return {"ops": len(ops), "touched": len(foreign), "unpinned": len(foreign - trace.pinned_sids),
            "moved": len(foreign & moved)}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def offload_matches_plain(rank: int, world: int, kind: str, fractions: tuple[float, ...]) -> dict[str, Any]:
    """Per budget fraction of the steady-state peak: whether losses and (sharded) parameters
    are bitwise equal to the plain run, and what each session step reported."""
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e9))
    _train(kind, rank, probe, steps=2)
    peak = probe.last_report.peak_resident_bytes  # a steady step (FSDP2 initialises in the first)
    plain_losses, plain_model, _ = _train(kind, rank, None)
    out: dict[str, Any] = {"peak": peak}
    for frac in fractions:
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=frac * peak / MIB))
        losses, model, steps = _train(kind, rank, session)
        out[frac] = {
            "losses_equal": all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True)),
            "params_equal": all(torch.equal(_local(a), _local(b)) for a, b in
                                zip(plain_model.parameters(), model.parameters(), strict=True)),
            "steps": steps,
        }
    return out


def variable_batches_match_plain(rank: int, world: int, kind: str, fraction: float) -> dict[str, Any]:
    """Each rank its own batch size every step (256..1024 rows, the ranks in another order:
    budgets of megabytes, so that replay's 64 KiB of slack is a few per cent), at ``fraction``
    of the largest batch's steady peak: bitwise equality and what each step reported."""
    rows = (256, 768, 384, 1024, 256, 640) if rank == 0 else (640, 256, 1024, 384, 768, 256)
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e9))
    _train(kind, rank, probe, steps=2, rows=(1024,))
    budget = int(fraction * probe.last_report.peak_resident_bytes)
    plain_losses, plain_model, _ = _train(kind, rank, None, steps=len(rows), rows=rows)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    losses, model, steps = _train(kind, rank, session, steps=len(rows), rows=rows)
    return {
        "budget": budget,
        "losses_equal": all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True)),
        "params_equal": all(torch.equal(_local(a), _local(b)) for a, b in
                            zip(plain_model.parameters(), model.parameters(), strict=True)),
        "steps": steps,
    }
