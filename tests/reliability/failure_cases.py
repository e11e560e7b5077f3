"""A step that fails after ``.numpy()`` pinned an activation's storage (numpy makes it
non-resizable): on main the page-in of that storage raised, ``restore_all`` stopped, and the
other tensors the user kept stayed at 0 bytes (reading one: SIGSEGV). Run in a child
interpreter by tests/reliability/test_failure_keeps_tensors_whole.py."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.offload.verify.lockstep import train_step
from tests.subprocess_harness import report_cases


class Injected(Exception):
    """The user's own error, raised in the middle of a step."""


class KeepsAndFails(nn.Module):
    """Keeps every activation in ``kept``; reads one with ``.numpy()``; raises when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))
        self.kept: list[torch.Tensor] = []
        self.read: list[np.ndarray] = []
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, side = x, x
        for i, layer in enumerate(self.layers[:4]):
            h = torch.tanh(layer(h))
            self.kept.append(h)
            if i == 0:  # idles until the end of forward: evicted below the peak
                side = torch.tanh(self.layers[4](h))
                self.kept.append(side)
            if i == 2:
                self.read.append(side.detach().numpy().copy())
            if i == 3 and self.fail:
                raise Injected("user error in the middle of a replay step")
        return h.sum() + side.sum()


def run_both(plain: nn.Module, off: nn.Module, session: OffloadSession,
             x: torch.Tensor) -> tuple[Exception | None, Exception | None]:
    """One step of a model that keeps activations in ``kept`` and of its copy inside
    ``session``; returns what each raised."""
    outcome: list[Exception | None] = []
    for model, sess in ((plain, None), (off, session)):
        model.kept.clear()
        try:
            train_step(model, (x,), sess)
            outcome.append(None)
        except Exception as exc:
            outcome.append(exc)
    return outcome[0], outcome[1]


def exception_after_numpy(budget_mb: float) -> None:
    torch.manual_seed(0)
    plain = KeepsAndFails()
    off = copy.deepcopy(plain)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget_mb))
    for step in range(3):  # warmup, a replay, then a replay that fails
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step))
        plain.fail = off.fail = step == 2
        outcome = run_both(plain, off, session, x)
        assert all(isinstance(o, Injected) == (step == 2) for o in outcome), f"step {step}: {outcome}"
        assert len(off.kept) == len(plain.kept), f"step {step}"
        for i, (a, b) in enumerate(zip(plain.kept, off.kept, strict=True)):
            need, has = b.numel() * b.element_size(), b.untyped_storage().nbytes()
            assert has >= need, f"step {step}: kept tensor {i} has a {has}-byte storage (needs {need})"
            assert torch.equal(a, b), f"step {step}: kept tensor {i} differs from plain PyTorch"
        assert np.array_equal(plain.read[-1], off.read[-1]), f"step {step}: .numpy() read other values"
        assert session.tracked_storages() == 0, f"step {step}"
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)


def cases() -> None:
    report_cases({"numpy then exception at budget 0": lambda: exception_after_numpy(0.0),
                  "numpy then exception at budget 4 KiB": lambda: exception_after_numpy(4 / 1024)})
