"""Train a model and its copy side by side, the copy inside an OffloadSession, and compare
the bits of the loss and of every gradient after each step (plain PyTorch is the oracle)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession, StepReport
from tests.reliability.bitwise import same_bits

MIB = 1 << 20


def session_at(budget_bytes: float, **config: Any) -> OffloadSession:
    return OffloadSession(OffloadConfig(max_resident_activation_mb=budget_bytes / MIB, **config))


def train_step(model: nn.Module, args: tuple[Any, ...], session: OffloadSession | None) -> torch.Tensor:
    """Forward to a scalar loss and backward, inside ``session`` when one is given."""
    if session is None:
        loss = model(*args)
        loss.backward()
        return loss.detach()
    with session:
        loss = model(*args)
        loss.backward()
    return loss.detach()


def measured_peak(build: Callable[[], nn.Module], args: tuple[Any, ...]) -> int:
    """The activation peak of one step, measured by a warmup that evicts nothing."""
    torch.manual_seed(0)
    session = session_at(1 << 50)
    train_step(build(), args, session)
    assert session.last_report is not None and session.last_report.peak_resident_bytes > 0
    return session.last_report.peak_resident_bytes


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_dense() if t is not None and t.layout != torch.strided else t


def differences(plain: nn.Module, off: nn.Module, loss_a: torch.Tensor | None,
                loss_b: torch.Tensor | None) -> list[str]:
    """Names of what differs bitwise: the loss, and each parameter's gradient (a sparse
    gradient, as ``nn.Embedding(sparse=True)`` makes, is compared dense)."""
    out = [] if same_bits(loss_a, loss_b) else [f"loss {loss_a} != {loss_b}"]
    for (name, pa), pb in zip(plain.named_parameters(), off.parameters(), strict=True):
        if not same_bits(_dense(pa.grad), _dense(pb.grad)):
            out.append(f"grad of {name}")
    return out


def sgd_and_zero(*models: nn.Module) -> None:
    """A plain update outside the session, so that every replay sees new values."""
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(0.05 * p.grad)
            model.zero_grad(set_to_none=True)


class Lockstep:
    """``plain`` and its deep copy ``off`` (run inside ``session``), stepped together."""

    def __init__(self, build: Callable[[], nn.Module], session: OffloadSession) -> None:
        torch.manual_seed(0)
        self.plain = build()
        self.off = copy.deepcopy(self.plain)
        self.session = session
        self.reports: list[StepReport] = []

    def step(self, *args: Any, where: str = "") -> StepReport:
        """One training step of both; fails naming what differs and the step's report."""
        loss_a = train_step(self.plain, args, None)
        loss_b = train_step(self.off, args, self.session)
        report = self.session.last_report
        assert report is not None
        self.reports.append(report)
        diff = differences(self.plain, self.off, loss_a, loss_b)
        assert not diff, f"{where} step {len(self.reports) - 1}: {diff} differ from plain PyTorch ({report})"
        assert self.session.tracked_storages() == 0, where
        sgd_and_zero(self.plain, self.off)
        return report
