"""Rank body: DDP steps whose lengths vary, plainly and inside a session (the hand-off at the
first saved tensor beside DDP's collectives); imported by the rank processes of
``test_fast_lengths_ddp``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession, StepReport
from tests.offload.ddp_training import train

MIB = 1 << 20
WIDTH = 64
# rows per step, this rank's (rank 1 shifted by one step: the ranks' lengths differ each step)
ROWS = [128] * 5 + [160] + [64, 128, 160, 96, 160, 144, 48, 160, 112]


def _ddp() -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(), nn.Linear(4 * WIDTH, WIDTH))
              for _ in range(3)]
    return DistributedDataParallel(nn.Sequential(*blocks, nn.Linear(WIDTH, 4)))


def _rows(rank: int, step: int) -> int:
    return ROWS[min(step + rank, len(ROWS) - 1)] if step >= 5 else ROWS[step]


def _train(rank: int, session: OffloadSession | None, steps: int
           ) -> tuple[list[list[torch.Tensor]], list[StepReport]]:
    torch.set_num_threads(1)
    reports: list[StepReport] = []
    results = train(_ddp(), session, steps,
                    lambda step: torch.randn(_rows(rank, step), WIDTH,
                                             generator=torch.Generator().manual_seed(100 * step + rank)),
                    reports.append)
    return results, reports


def ddp_lengths_match_plain(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Per step whether loss and gradients in the session are bitwise plain DDP's, and the
    session's path, checked prefix and peak per step, and its budget."""
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e9))
    probe_model = _ddp()
    with probe:
        probe_model(torch.randn(max(ROWS), WIDTH)).square().mean().backward()
    assert probe.last_report is not None
    budget = 0.75 * probe.last_report.peak_resident_bytes
    expected, _ = _train(rank, None, steps)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    got, reports = _train(rank, session, steps)
    return {"equal": [all(torch.equal(a, b) for a, b in zip(e, g, strict=True))
                      for e, g in zip(expected, got, strict=True)],
            "paths": [r.replay_path for r in reports],
            "prefix": [r.checked_prefix_ops for r in reports],
            "peak": [r.peak_resident_bytes for r in reports], "budget": budget}
