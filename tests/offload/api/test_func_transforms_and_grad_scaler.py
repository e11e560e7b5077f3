"""Gradients taken with ``torch.func`` (``grad``, and ``vmap(grad)`` for per-sample gradients)
and an fp16 autocast step with ``torch.amp.GradScaler``, inside a session at a budget that
moves activations: bitwise equal to the same step without the session, warmup and replays.
Coverage of the stack docs/works_with.md lists (these passed when added)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.step_context import step_context

MIB = 1 << 20


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(128, 128, generator=g) / 12).requires_grad_() for _ in range(6)]


def _loss(params: tuple[torch.Tensor, ...] | list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = x
    for w in params:
        h = torch.tanh(h @ w)
    return h.square().mean()


def _func_grad(ws: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.func.grad(_loss)(tuple(ws), x))


def _per_sample(ws: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    one = torch.func.grad(lambda p, row: _loss(p, row[None]))
    return [g.sum(0) for g in torch.func.vmap(one, in_dims=(None, 0))(tuple(ws), x[:16])]


def _scaled(ws: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _loss(ws, x)
    scaler.scale(loss).backward()
    scaler.unscale_(torch.optim.SGD(ws, lr=0.0))
    return [w.grad for w in ws]


Grads = Callable[[list[torch.Tensor], torch.Tensor], list[torch.Tensor]]


@pytest.mark.parametrize("grads", [_func_grad, _per_sample, _scaled],
                         ids=["grad", "vmap_grad", "grad_scaler"])
def test_bitwise_inside_a_session(grads: Grads) -> None:
    torch.set_num_threads(1)
    ws = _weights()
    x = torch.randn(512, 128, generator=torch.Generator().manual_seed(1))

    def run(session: OffloadSession | None) -> list[torch.Tensor]:
        for w in ws:
            w.grad = None
        with step_context(session):
            return [g.clone() for g in grads(ws, x)]

    expected = run(None)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.6))
    for step in range(3):
        got = run(session)
        report = session.last_report
        assert report is not None and report.phase == ("warmup" if step == 0 else "replay")
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), report
        assert report.bytes_d2h > 0, report
        feasible = max(0.6 * MIB, report.min_feasible_budget_bytes or 0)
        slack = max(0.05 * feasible, 64 << 10)  # replay's
        assert report.peak_resident_bytes <= feasible + slack, report
