"""A step whose ``with session:`` fails inside ``__enter__`` (an interrupt, memory running
out) leaves no dispatch mode, saved-tensor hook or active state behind: plain PyTorch runs
unhooked after it, and the session's next steps run and stay bitwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hyperpar.offload.api.session as session_module
from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.capture import current_offload_mode


def _step(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_an_interrupt_inside_enter_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    x = torch.randn(16, 32)
    expected = _step(model, x)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6))
    real = session_module.SavedTensorGuard
    made = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        if len(made) == 2:  # the first checked replay's guard: after the dispatch mode entered
            raise KeyboardInterrupt("interrupted in __enter__")
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module, "SavedTensorGuard", interrupted)
    with session:
        got = _step(model, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    with pytest.raises(KeyboardInterrupt), session:
        pass
    assert current_offload_mode() is None and torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    assert all(torch.equal(a, b) for a, b in zip(expected, _step(model, x), strict=True))  # plain, unhooked
    for _ in range(3):
        with session:
            got = _step(model, x)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert session.last_report is not None and session.last_report.phase == "replay"
    assert session.tracked_storages() == 0
