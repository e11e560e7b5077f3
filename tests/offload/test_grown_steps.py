"""A step much larger than every plan of its structure (here 2.7x the tokens of the only
one, attention-like scores 7x) replays that plan at its own sizes: within the budget when
the budget is feasible at those sizes, bitwise equal to plain PyTorch, and its report gives
the floor of its own sizes, the one a fresh session's warmup of that step reports."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.step_context import step_context

MIB = 1 << 20
D = 64


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(D, D, generator=g) / 8).requires_grad_() for _ in range(8)]


def _step(session: OffloadSession | None, x: torch.Tensor, ws: list[torch.Tensor],
          loss_of: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """One training step of ``loss_of(x)``, in ``session`` if given: the loss and every grad."""
    for w in ws:
        w.grad = None
    with step_context(session):
        loss = loss_of(x)
        loss.backward()
    return (loss.detach(), *(w.grad.clone() for w in ws))  # type: ignore[union-attr]


def _run(session: OffloadSession | None, length: int, ws: list[torch.Tensor], batch: int = 2
         ) -> tuple[torch.Tensor, ...]:
    def attention_like(h: torch.Tensor) -> torch.Tensor:
        for k in range(0, len(ws), 2):
            q = h @ ws[k]
            scores = (q @ q.transpose(1, 2)) / D  # [2, L, L]: the square of the length
            h = torch.relu((scores.softmax(-1) @ q) @ ws[k + 1]) + h
        return h.square().mean()

    x = torch.randn(batch, length, D, generator=torch.Generator().manual_seed(length))
    return _step(session, x, ws, attention_like)


def _session(budget: int) -> OffloadSession:
    """The checked path (a plan that moves nothing would take the fast path, whose departure
    at another size is covered by tests/offload/test_fast_replay.py)."""
    return OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, fast_replay=False))


@pytest.mark.parametrize("fraction", [0.4, 0.6])
def test_a_step_much_larger_than_its_plan_keeps_a_feasible_budget(fraction: float) -> None:
    torch.set_num_threads(1)
    ws = _weights()
    probe = _session(1 << 40)
    _run(probe, 256, ws)
    assert probe.last_report is not None
    budget = int(probe.last_report.peak_resident_bytes * fraction)
    fresh = _session(budget)  # what a warmup of the large step alone reports
    _run(fresh, 256, ws)
    assert fresh.last_report is not None
    floor = fresh.last_report.min_feasible_budget_bytes
    assert floor is not None and floor < budget  # feasible
    session = _session(budget)
    for length, phase in ((96, "warmup"), (96, "replay"), (256, "replay"), (256, "replay")):
        expected, got = _run(None, length, ws), _run(session, length, ws)
        report = session.last_report
        assert report is not None and report.phase == phase, report
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), report
        assert report.diverged_at is None, report
        assert report.peak_resident_bytes <= budget * 1.05, f"length {length}: {report}"
        if length == 256:
            assert report.min_feasible_budget_bytes == floor, report


def test_a_step_of_the_same_tokens_but_longer_rows_keeps_the_budget() -> None:
    """Batch 4 x 96 then batch 2 x 192: the first activation (the tokens) is the same size,
    so the step follows its plan without growth, but its scores are twice the plan's; the
    first op that makes more than planned turns the rest of the step careful."""
    torch.set_num_threads(1)
    ws = _weights()
    probe = _session(1 << 40)
    _run(probe, 192, ws, batch=2)
    assert probe.last_report is not None
    budget = int(probe.last_report.peak_resident_bytes * 0.4)
    fresh = _session(budget)
    _run(fresh, 192, ws, batch=2)
    assert fresh.last_report is not None and fresh.last_report.min_feasible_budget_bytes is not None
    assert fresh.last_report.min_feasible_budget_bytes < budget  # feasible
    session = _session(budget)
    for length, batch, phase in ((96, 4, "warmup"), (96, 4, "replay"), (192, 2, "replay")):
        expected, got = _run(None, length, ws, batch), _run(session, length, ws, batch)
        report = session.last_report
        assert report is not None and report.phase == phase, report
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), report
        assert report.peak_resident_bytes <= budget * 1.05, f"{batch} x {length}: {report}"


def test_a_storage_empty_at_the_plans_size_may_fill_at_another() -> None:
    """``h[:, 96:]`` is empty at length 96 and not at 128: the plan made at 96 binds no storage
    for it (an empty output is no activation), so at 128 that op's bytes go untracked; the
    step must still replay bitwise."""
    torch.set_num_threads(1)
    ws = _weights()

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ ws[0])
        tail = (h[:, 96:] @ ws[1]).sum()  # nothing at length 96
        return (h @ ws[2]).square().mean() + tail

    def run(session: OffloadSession | None, length: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(2, length, D, generator=torch.Generator().manual_seed(length))
        return _step(session, x, ws[:3], loss_of)

    probe = _session(1 << 40)
    run(probe, 128)
    assert probe.last_report is not None
    session = _session(int(probe.last_report.peak_resident_bytes * 0.5))
    for length in (96, 96, 128, 128):
        expected, got = run(None, length), run(session, length)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), session.last_report
