"""The fast path: a plan that moves nothing runs without the dispatch mode once a checked
replay of it ran clean; every kind of departure from the plan is caught at the first saved
tensor that differs and the step finishes bitwise equal, within the budget, online. Each
departure test fails if the fingerprint field that catches it is removed (the step would
report "fast")."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.api.fast_steps import FAST_DEPARTURES
from hyperpar.offload.capture import current_offload_mode
from tests.step_context import step_context

# the planner's link fixed: these tests assert which path a plan takes (see conftest)
pytestmark = pytest.mark.usefixtures("steady_link")

MIB = 1 << 20
D = 32


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(D, D, generator=g) / 4).requires_grad_() for _ in range(4)]


Body = Callable[[torch.Tensor, list[torch.Tensor], int], torch.Tensor]


def _plain_body(x: torch.Tensor, ws: list[torch.Tensor], step: int) -> torch.Tensor:
    h = x
    for w in ws:
        h = torch.tanh(h @ w) + h
    return h.square().mean()


def _run(session: OffloadSession | None, body: Body, ws: list[torch.Tensor], step: int, length: int = 64,
         seen: list[object] | None = None) -> tuple[torch.Tensor, ...]:
    for w in ws:
        w.grad = None
    x = torch.randn(length, D, generator=torch.Generator().manual_seed(step))
    with step_context(session):
        if seen is not None:
            seen.append(current_offload_mode())
        loss = body(x, ws, step)
        loss.backward()
    grads = [torch.zeros_like(w) if w.grad is None else w.grad.clone() for w in ws]
    with torch.no_grad():  # an optimizer step between steps: parameters' versions move
        for w, g in zip(ws, grads, strict=True):
            w.sub_(0.01 * g)
    return (loss.detach(), *grads)


def _peak(body: Body, length: int = 64) -> int:
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6))
    _run(probe, body, _weights(), 0, length)
    assert probe.last_report is not None
    return probe.last_report.peak_resident_bytes


def _steps(body: Body, budget: int, lengths: list[int], grown_slack: int = 0,
           **config: object) -> tuple[OffloadSession, list]:
    """Each step in a session and plainly, bitwise compared; the session's reports.
    ``grown_slack``: bytes over the budget a checked step may hold (one larger than its plan
    holds up to replay's slack before it evicts beyond the plan)."""
    torch.set_num_threads(1)
    plain_ws, ws = _weights(), _weights()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, **config))  # type: ignore[arg-type]
    reports = []
    for step, length in enumerate(lengths):
        expected, got = _run(None, body, plain_ws, step, length), _run(session, body, ws, step, length)
        report = session.last_report
        assert report is not None
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), report
        slack = grown_slack if report.replay_path == "checked" else 0
        assert report.peak_resident_bytes <= max(budget * 1.05, budget + slack), report
        assert session.tracked_storages() == 0
        reports.append(report)
    return session, reports


def test_a_plan_that_moves_nothing_runs_without_the_dispatch_mode() -> None:
    budget = _peak(_plain_body)
    torch.set_num_threads(1)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    ws, modes = _weights(), []
    paths = []
    for step in range(5):
        _run(session, _plain_body, ws, step, seen=modes)
        assert session.last_report is not None
        paths.append(session.last_report.replay_path)
    assert paths == [None, "checked", "fast", "fast", "fast"]
    assert [m is None for m in modes] == [False, False, True, True, True]  # no mode on the fast steps
    assert session.last_report.peak_resident_bytes == budget  # the plan's peak, which matched
    _, reports = _steps(_plain_body, budget, [64] * 4)
    assert [r.replay_path for r in reports] == [None, "checked", "fast", "fast"]


def test_fast_replay_off_keeps_every_step_checked() -> None:
    _, reports = _steps(_plain_body, _peak(_plain_body), [64] * 4, fast_replay=False)
    assert [r.replay_path for r in reports] == [None, "checked", "checked", "checked"]


def test_another_length_falls_back_and_keeps_the_budget() -> None:
    """Shape: a step at twice the plan's length departs at its first saved tensor and keeps
    a budget it could not keep plainly (activations move off the device online); the next
    64 step starts checked and goes fast at its first saved tensor, which the plan covers."""
    budget = _peak(_plain_body)
    _, reports = _steps(_plain_body, budget, [64, 64, 64, 128, 64])
    assert [r.replay_path for r in reports] == [None, "checked", "fast", "fallback", "fast"]
    grown = reports[3]
    assert grown.departed_at_saved == 0 and grown.bytes_d2h > 0, grown
    assert _peak(_plain_body, 128) > budget * 1.05  # plainly, this step would be over


def _aliasing(x: torch.Tensor, ws: list[torch.Tensor], step: int) -> torch.Tensor:
    """Which activation a product reads twice depends on the step (data-dependent aliasing)."""
    a, b = torch.tanh(x @ ws[0]), torch.sin(x @ ws[1])
    z = a if step < 3 else b
    return (z * a).sum() + (b @ ws[2]).square().mean()


def _inplace(x: torch.Tensor, ws: list[torch.Tensor], step: int) -> torch.Tensor:
    """Which activation an in-place op writes depends on the step (both are saved later: a
    write to a tensor no backward reads changes nothing a plan that moves nothing relies on)."""
    a, b = x @ ws[0], x @ ws[1]
    (a if step < 3 else b).mul_(0.5)
    return (a * b).tanh().sum()


def _new_op(x: torch.Tensor, ws: list[torch.Tensor], step: int) -> torch.Tensor:
    """An op the plan does not have (it saves one tensor more)."""
    h = torch.tanh(x @ ws[0])
    if step >= 3:
        h = h.sin()
    return (h @ ws[1]).square().mean()


@pytest.mark.parametrize("body", [_aliasing, _inplace, _new_op],
                         ids=["aliasing", "in-place target", "new op"])
def test_each_departure_is_caught_on_the_fast_path(body: Body) -> None:
    budget = int(_peak(body) * 1.2)
    _, reports = _steps(body, budget, [64] * 5)
    assert [r.replay_path for r in reports] == [None, "checked", "fast", "fallback", "checked"], reports
    assert reports[3].departed_at_saved is not None


_NEW_OP_AT = [0, 0, 0, 1, 0, 1, 0, 1, 0, 0, 0, 0]


def _new_op_at_times(x: torch.Tensor, ws: list[torch.Tensor], step: int) -> torch.Tensor:
    """A data-dependent extra op on some steps: the step after one without it is predicted
    to be like it, and departs from its plan past the first saved tensor."""
    h = torch.tanh(x @ ws[0])
    if _NEW_OP_AT[step]:
        h = h.sin()
    return (h @ ws[1]).square().mean()


def test_a_structure_that_departs_twice_stays_checked() -> None:
    body = _new_op_at_times
    session, reports = _steps(body, int(_peak(body) * 1.2), [64] * len(_NEW_OP_AT))
    paths = [r.replay_path for r in reports]
    assert paths[:6] == [None, "checked", "fast", "fallback", "checked", "fallback"], paths
    assert set(paths[6:]) == {"checked"}, paths
    assert sorted(st.departures for st in session._structures.values()) == [0, FAST_DEPARTURES]


def test_steps_of_two_lengths_each_take_their_own_plans_fast_path() -> None:
    """Another length is not a departure to hold against the structure: at its first saved
    tensor, nothing moved yet, the step takes its own size's plan if that one learned its
    saved tensors, else falls back and the next steps are checked until it has."""
    budget = int(_peak(_plain_body, 96) * 1.1)
    session, reports = _steps(_plain_body, budget, [64, 96] * 7)
    paths = [r.replay_path for r in reports]
    assert paths[-6:] == ["fast"] * 6, paths
    assert paths.count("fallback") <= 1, paths
    structure = next(iter(session._structures.values()))
    assert structure.departures == 0 and len(structure.sizes) == 2
    assert all(plan.packs for plan in structure.sizes.values())
    # each fast step ran its own size's plan: a 96 step reports the 96 plan's peak
    peaks = {r.peak_resident_bytes for r in reports[-2:]}
    assert len(peaks) == 2, reports[-2:]


def test_torch_func_in_a_step_runs_and_never_takes_the_fast_path() -> None:
    """torch.func's transforms refuse saved-tensor hooks: the session's guard steps aside."""
    def body(x: torch.Tensor, ws: list[torch.Tensor], step: int) -> torch.Tensor:
        inner = torch.func.grad(lambda w: torch.tanh(x @ w).sum())(ws[0].detach())
        return (torch.tanh(x @ ws[1]) * inner.sum()).mean()

    _, reports = _steps(body, _peak(body) * 2, [64] * 4)
    assert [r.replay_path for r in reports] == [None, "checked", "checked", "checked"]
