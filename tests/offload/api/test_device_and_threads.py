"""The session binds its device at the first step, and finds itself from autograd's threads.

Autograd runs an accelerator's backward on device threads, which get the step's thread-local
state (the dispatch mode stack among it) but not Python context variables. CPU backward runs
on the calling thread, so the same hand-over is reproduced here with TorchScript's
``fork``: its task runs on an inter-op thread with the caller's thread-local state, and
calls ``torch.autograd.grad`` there.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession, skip_offload
from hyperpar.offload.api import config as config_module

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def test_device_is_the_current_one_at_the_first_step_not_at_construction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    current = [torch.device("cpu", 0)]  # stands for "cuda:0, before set_device(local_rank)"
    monkeypatch.setattr(config_module, "resolve_device", lambda device: current[0])
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    assert session.device == torch.device("cpu", 0)
    current[0] = torch.device("cpu")  # stands for set_device(local_rank)
    x = torch.randn(16, 16, requires_grad=True)
    with session:
        x.tanh().tanh().sum().backward()
    assert session.device == torch.device("cpu")
    assert session.last_report.bytes_d2h > 0  # the storages were tracked on the bound device
    current[0] = torch.device("cpu", 0)  # a later change does not move a session that has plans
    with session:
        x.tanh().tanh().sum().backward()
    assert session.device == torch.device("cpu") and session.last_report.phase == "replay"


_seen: list[tuple[int, OffloadSession | None]] = []


@skip_offload
def _scaled(g: torch.Tensor) -> torch.Tensor:
    return g * 2


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)  # type: ignore[attr-defined]
        return x * 2

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        _seen.append((threading.get_ident(), OffloadSession.get_active()))
        return _scaled(g) * x


def _grad_elsewhere() -> object:
    from typing import Optional

    def grad_of(loss: torch.Tensor, x: torch.Tensor) -> list[Optional[torch.Tensor]]:  # noqa: UP045
        return torch.autograd.grad([loss], [x])

    def forked(loss: torch.Tensor, x: torch.Tensor) -> list[Optional[torch.Tensor]]:  # noqa: UP045
        return torch.jit.wait(torch.jit.fork(scripted, loss, x))

    scripted = torch.jit.script(grad_of)
    return torch.jit.script(forked)


def test_active_session_and_skip_offload_inside_backward_on_another_thread() -> None:
    forked = _grad_elsewhere()
    x = torch.randn(32, requires_grad=True)
    expected = torch.autograd.grad([_Doubled.apply(x.tanh()).tanh().sum()], [x])[0]
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    _seen.clear()
    for _ in range(3):
        with session:
            (grad,) = forked(_Doubled.apply(x.tanh()).tanh().sum(), x)  # type: ignore[operator]
        assert torch.equal(grad, expected)
    me = threading.get_ident()
    assert len(_seen) == 3
    assert all(thread != me and active is session for thread, active in _seen)
    names = [op.name for op in session.trace.ops]
    assert "skip_offload(_scaled)" in names and "aten.tanh_backward.default" in names
    assert session.last_report.phase == "replay" and session.last_report.diverged_at is None
    assert session.last_report.bytes_d2h > 0
