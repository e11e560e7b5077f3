"""Rank body: a tensor-parallel MLP stack (DTensor activations) trained plain and in a session."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.step_context import step_context

MIB = 1 << 20


def _model(mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                            for _ in range(4)])
    for block in model:
        parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def _train(mesh: Any, session: OffloadSession | None,
           steps: int) -> tuple[list[list[torch.Tensor]], list[dict[str, Any]]]:
    """Each step another batch size; returns every step's loss and local gradients."""
    model = _model(mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results, reports = [], []
    for step in range(steps):
        x = torch.randn(96 + 32 * (step % 3), 64, generator=torch.Generator().manual_seed(step))
        with step_context(session):
            loss = model(x).square().mean()
            loss.backward()
        results.append([loss.detach()] + [p.grad.to_local().clone() for p in model.parameters()])
        if session is not None:
            reports.append(session.last_report.as_dict())
        optimizer.step()
        optimizer.zero_grad()
    return results, reports


def tensor_parallel_matches_plain(rank: int, world_size: int, budget_mb: float, steps: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    expected, _ = _train(mesh, None, steps)
    got, reports = _train(mesh, OffloadSession(OffloadConfig(max_resident_activation_mb=budget_mb)), steps)
    return {"equal": [all(torch.equal(a, b) for a, b in zip(e, g, strict=True))
                      for e, g in zip(expected, got, strict=True)],
            "reports": reports}
