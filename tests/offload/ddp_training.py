"""The SGD loop the DDP rank bodies share: per step the loss and every gradient, plainly or
inside a session (``tests.step_context``), with each session step's report handed on."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hyperpar.offload import OffloadSession, StepReport
from tests.step_context import step_context


def train(model: nn.Module, session: OffloadSession | None, steps: int, batch: Callable[[int], torch.Tensor],
          on_report: Callable[[StepReport], None] | None = None) -> list[list[torch.Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for step in range(steps):
        x = batch(step)
        with step_context(session):
            loss = model(x).square().mean()
            loss.backward()
        results.append([loss.detach().clone()] + [p.grad.detach().clone() for p in model.parameters()])
        if session is not None and on_report is not None:
            assert session.last_report is not None
            on_report(session.last_report)
        optimizer.step()
        optimizer.zero_grad()
    return results
