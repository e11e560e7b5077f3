"""Rank body: DDP steps plainly and inside a session with the disk tier (issue 42), per rank;
imported by the rank processes of ``test_disk_tier_composes``."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession, StepReport
from hyperpar.offload.runtime.disk_store import FILE_PREFIX
from tests.offload.ddp_training import train
from tests.offload.disk.test_disk_tier_session import _said_past

MIB = 1 << 20
WIDTH = 64


def _ddp() -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
              for _ in range(4)]
    return DistributedDataParallel(nn.Sequential(*blocks, nn.Linear(WIDTH, 8)))


def _train(rank: int, session: OffloadSession | None, steps: int
           ) -> tuple[list[list[torch.Tensor]], list[int]]:
    """SGD steps on this rank's batches: per step the loss and every gradient, and (in a
    session) the bytes each step wrote to disk."""
    to_disk: list[int] = []

    def seen(report: StepReport) -> None:
        assert session is not None
        to_disk.append(report.bytes_to_disk)
        # past the host budget only for a read no room could be made for, which the tier says
        assert (report.peak_host_bytes <= (session.config.host_budget_bytes or 0)
                or _said_past(session)), str(report)

    def batch(step: int) -> torch.Tensor:
        return torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))

    results = train(_ddp(), session, steps, batch, seen)
    return results, to_disk


def ddp_with_disk_tier_matches_plain(rank: int, world: int, root: str, shared: bool, steps: int
                                     ) -> dict[str, Any]:
    """Per step whether loss and gradients with the disk tier are bitwise plain DDP's, the bytes
    each step wrote to disk, and this rank's files in its directory (``root``, or its own folder
    ``root/rank<r>``) while open and after close."""
    disk_dir = root if shared else os.path.join(root, f"rank{rank}")
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e9))
    _train(rank, probe, 2)
    assert probe.last_report is not None
    peak = probe.last_report.peak_resident_bytes
    expected, _ = _train(rank, None, steps)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.5 * peak / MIB,
                                           max_host_activation_mb=0.2 * peak / MIB, disk_dir=disk_dir))
    got, to_disk = _train(rank, session, steps)
    store = session._manager.tier.store if session._manager.tier is not None else None
    mine = None if store is None else os.path.basename(store.path)
    open_files = [n for n in os.listdir(disk_dir) if n.startswith(FILE_PREFIX)]
    session.close()
    left = [n for n in os.listdir(disk_dir) if n == mine]
    return {"equal": [all(torch.equal(a, b) for a, b in zip(e, g, strict=True))
                      for e, g in zip(expected, got, strict=True)],
            "to_disk": to_disk, "mine": mine, "open": open_files, "left": left}
