"""Tensor subclasses with their own ``__torch_dispatch__`` inside a session: the subclass takes
each op and calls ops on the plain tensors it holds, and the session traces those. Nested
jagged tensors (variable-length batches without padding) are the case users meet: before the
session stepped aside for subclasses, an op on one ran as one opaque op, the plain values it
read were evicted under it and the backward failed ("data is not allocated yet")."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.step_context import step_context

MIB = 1 << 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 64))


def _jagged(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(20, 120, (6,), generator=g).tolist()
    return torch.nested.nested_tensor([torch.randn(n, 64, generator=g) for n in lengths],
                                      layout=torch.jagged)


def _step(model: nn.Module, batch: torch.Tensor, session: OffloadSession | None) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    with step_context(session):
        out = model(batch)
        # ``values()`` is a plain view of the subclass's buffer: read directly and through the
        # subclass's ops in backward
        loss = out.values().square().mean() + out.values()[:, :8].abs().sum() * 1e-3
        loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("budget_mb", [0.0, 0.3])
def test_nested_jagged_batches_of_varying_lengths(budget_mb: float) -> None:
    torch.set_num_threads(1)
    model = _model()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget_mb))
    phases = []
    for step in range(4):
        expected = _step(model, _jagged(step), None)
        got = _step(model, _jagged(step), session)
        report = session.last_report
        assert report is not None
        phases.append(report.phase)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), report
        # the subclass's plain activations are seen, so they move
        assert report.bytes_d2h > 0, report
        feasible = max(budget_mb * MIB, report.min_feasible_budget_bytes or 0)
        assert report.peak_resident_bytes <= feasible + max(0.05 * feasible, 64 << 10), report
    assert phases.count("warmup") == 1, phases


class _Scaled(torch.Tensor):
    """A minimal wrapper subclass: a plain tensor and a scale, applied on every op."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor, scale: float) -> _Scaled:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   device=inner.device,
                                                   requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor, scale: float) -> None:
        self.inner, self.scale = inner, scale

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        seen.append(func)
        plain = torch.utils._pytree.tree_map_only(_Scaled, lambda t: t.inner * t.scale, (args, kwargs or {}))
        return func(*plain[0], **plain[1])


seen: list[object] = []


def test_a_subclass_sees_its_ops_and_the_session_its_inner_ones() -> None:
    torch.set_num_threads(1)
    w = torch.randn(32, 32)
    x = _Scaled(torch.randn(64, 32), 0.5)
    seen.clear()
    expected = torch.mm(x, w).relu()
    calls = len(seen)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.0))
    seen.clear()
    with session:
        got = torch.mm(x, w).relu()
    assert torch.equal(expected, got)
    assert len(seen) == calls == 1  # the subclass took the mm; relu ran on its plain result
    # the session traced the plain ops: the scaling mul, the mm and the relu
    assert session.last_report is not None and session.last_report.op_count == 3, session.last_report
