"""Session lifecycle: phases, nesting, exceptions, divergence, skip_offload, stale copies."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadDivergenceError, OffloadSession, skip_offload
from hyperpar.offload.ir import ActivationTrace, ResidencyActionType, ResidencySchedule
from hyperpar.offload.planning import get_planner


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))


def _grads(model: nn.Module, x: torch.Tensor, session: OffloadSession | None = None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if session is None:
        model(x).square().sum().backward()
    else:
        with session:
            model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _x(batch: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 8, generator=torch.Generator().manual_seed(seed))


def test_phases_trace_schedule_and_active_session() -> None:
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    assert session.phase == "warmup" and session.trace is None and session.schedule is None
    assert OffloadSession.get_active() is None
    model = _mlp()
    model.zero_grad(set_to_none=True)
    with session as entered:
        assert entered is session and OffloadSession.get_active() is session
        model(_x()).sum().backward()
    assert OffloadSession.get_active() is None
    assert session.phase == "replay" and session.last_report.phase == "warmup"
    assert session.trace is not None and session.schedule is not None
    assert session.schedule.num_ops == session.trace.num_ops == session.last_report.op_count
    held = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)  # else the step differs: grads accumulate with add_
        with session:
            model(_x()).sum().backward()
        assert session.last_report.phase == "replay" and session.last_report.bytes_d2h > 0
        held.append(session.held_bytes())
    assert held[0] > 0 and held == [held[0]] * 3  # host slabs are reused, not re-allocated


def test_reentry_and_nesting_are_errors() -> None:
    a, b = OffloadSession(), OffloadSession()
    with a:
        with pytest.raises(RuntimeError, match="re-entrant"), a:
            pass
        with pytest.raises(RuntimeError, match="nested"), b:
            pass
        assert OffloadSession.get_active() is a
    assert OffloadSession.get_active() is None


def test_session_rejects_a_non_config_and_a_missing_device() -> None:
    with pytest.raises(TypeError, match="OffloadConfig"):
        OffloadSession({"max_resident_activation_mb": 1})  # type: ignore[arg-type]
    if not torch.accelerator.is_available():
        with pytest.raises(ValueError, match="device='cuda'"):
            OffloadSession(OffloadConfig(device="cuda"))


class _Boom(nn.Module):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc, self.armed = exc, False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise self.exc
        return h


@pytest.mark.parametrize("exc", [ValueError("boom"), KeyboardInterrupt()], ids=["ValueError", "Interrupt"])
@pytest.mark.parametrize("phase", ["warmup", "replay"])
def test_exception_mid_step_frees_everything_and_session_stays_usable(exc: BaseException, phase: str) -> None:
    torch.manual_seed(0)
    boom = _Boom(exc)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), boom, nn.Linear(32, 2))
    reference = copy.deepcopy(model)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    if phase == "replay":
        _grads(model, _x(), session)
    keep = []
    boom.armed = True
    with pytest.raises(type(exc)), session:
        h = model[0](_x())
        keep.append(h)  # a tensor the user keeps: evicted now, must be whole afterwards
        model(_x())
    assert session.phase == phase
    assert session.held_bytes() == 0 and session.tracked_storages() == 0
    assert OffloadSession.get_active() is None
    assert torch.equal(keep[0], reference[0](_x()))
    boom.armed = False
    assert _equal(_grads(model, _x(), session), _grads(reference, _x()))
    assert session.last_report.phase == phase


def test_another_batch_size_replays_the_structure_and_stays_correct() -> None:
    """Plans are keyed by structure, not sizes: batch 10 after batch 6 replays (no warmup, no
    divergence), and its sizes are planned right after the step."""
    model, reference = _mlp(), _mlp()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    for _ in range(2):
        assert _equal(_grads(model, _x(6), session), _grads(reference, _x(6)))
    small = session.schedule
    for seed in (0, 1):
        assert _equal(_grads(model, _x(10, seed), session), _grads(reference, _x(10, seed)))
        report = session.last_report
        assert report.phase == "replay" and report.diverged_at is None and report.peak_resident_bytes > 0
    assert session.schedule is not small  # planned for batch 10 after its first step
    assert session.trace.storage_sizes != small and len(session._structures) == 1
    assert _equal(_grads(model, _x(6, 2), session), _grads(reference, _x(6, 2)))
    assert session.schedule is small  # batch 6 again: its own plan


class _Switch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 2)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(self.fc1(x).relu())
        if self.extra:
            h = h * 0.5  # one more op in the middle of the step
        return self.fc3(h.tanh())


def test_changed_op_sequence_stays_correct() -> None:
    torch.manual_seed(0)
    model = _Switch()
    reference = copy.deepcopy(model)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    for extra in (False, False, True, True, True):
        model.extra = reference.extra = extra
        assert _equal(_grads(model, _x(), session), _grads(reference, _x()))
    assert session.last_report.phase == "replay" and session.last_report.diverged_at is None


def test_raise_on_divergence_names_the_op_and_frees_everything() -> None:
    torch.manual_seed(0)
    model = _Switch()
    reference = copy.deepcopy(model)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0, on_divergence="raise"))
    _grads(model, _x(), session)
    _grads(model, _x(), session)
    model.extra = True
    pattern = r"at op \d+: expected aten\.\w+\.\w+ -> \[.*\], got aten\.mul"
    with pytest.raises(OffloadDivergenceError, match=pattern):
        _grads(model, _x(), session)
    assert session.held_bytes() == 0 and session.tracked_storages() == 0
    # Raised once for the new structure: the next step is traced, then both kinds replay
    # (a step of either kind switches to its known plan) and nothing raises any more.
    assert session.phase == "warmup"
    reference.extra = True
    for extra in (True, True, False, True, False, False):
        model.extra = reference.extra = extra
        assert _equal(_grads(model, _x(), session), _grads(reference, _x()))
        assert session.last_report.diverged_at is None
    assert session.phase == "replay"
    model.extra = reference.extra = False  # another batch size is the same structure
    assert _equal(_grads(model, _x(7), session), _grads(reference, _x(7)))
    assert session.last_report.diverged_at is None


def test_fewer_ops_than_the_trace_is_a_divergence() -> None:
    model = _mlp()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0, on_divergence="raise"))
    x = _x()
    _grads(model, x, session)
    with pytest.raises(OffloadDivergenceError, match="ended after"), session:
        model(x).square().sum()  # forward only: the trace also had the backward
    assert session.held_bytes() == 0 and session.phase == "replay"
    retrace = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    _grads(model, x, retrace)
    with retrace:
        model(x).square().sum()
    assert retrace.last_report.diverged_at is not None and retrace.phase == "replay"
    with retrace:  # the forward-only step traced itself: it is a known plan now
        model(x).square().sum()
    assert retrace.last_report.diverged_at is None


def test_skip_offload_contract() -> None:
    with pytest.raises(TypeError, match="skip_offload needs a callable, got 3"):
        skip_offload(3)  # type: ignore[arg-type]

    @skip_offload
    def region(a: torch.Tensor, scale: float = 2.0) -> tuple[torch.Tensor, int]:
        return (a * scale).sin() + a, 7

    assert region.__name__ == "region"
    x = torch.randn(5)
    out, seven = region(x)  # outside a session: a plain call
    assert seven == 7 and torch.equal(out, (x * 2.0).sin() + x)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    with session, torch.no_grad():
        region(x)
    names = [op.name for op in session.trace.ops]
    assert names == ["skip_offload(test_skip_offload_contract.<locals>.region)"]
    w = torch.randn(5, requires_grad=True)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    for _ in range(2):
        w.grad = None
        with session:
            out, _ = region(x * w, scale=3.0)
            out.sum().backward()
        w_ref = w.detach().clone().requires_grad_(True)
        region(x * w_ref, scale=3.0)[0].sum().backward()  # outside a session: plain autograd
        assert torch.equal(w.grad, w_ref.grad)
    names = [op.name for op in session.trace.ops]
    opaque = [n for n in names if n.startswith("skip_offload")]
    assert opaque == ["skip_offload(test_skip_offload_contract.<locals>.region)",
                      "skip_offload(test_skip_offload_contract.<locals>.region).backward"]
    assert not any("sin" in n or "cos" in n for n in names)  # inner ops are not traced


def test_stale_host_copy_is_never_brought_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage evicted once, written in place, then evicted again must be copied again."""
    # memory given back at once needs copies done at once (the thread engine runs these small
    # ones inline); the chaos engine frees a storage once its copy out is done, counting it until then
    monkeypatch.delenv("HYPERPAR_COPY_ENGINE", raising=False)
    w = torch.randn(64, requires_grad=True)

    held_while_evicted: list[int] = []

    def step(session: OffloadSession | None) -> tuple[torch.Tensor, torch.Tensor]:
        w.grad = None
        x = torch.linspace(-1, 1, 64)

        def body() -> torch.Tensor:
            a = x * 2.0  # no grad: `a` may be written in place
            t1 = (w * 3.0).sin()
            if session is not None:
                held_while_evicted.append(a.untyped_storage().nbytes())  # not an op: no page-in
            a.add_(1.0)  # `a` was evicted before this write (budget 0)
            t2 = (w * 5.0).cos()
            return (a * w).sum() + t1.sum() + t2.sum()

        if session is None:
            loss = body()
            loss.backward()
        else:
            with session:
                loss = body()
                loss.backward()
        return loss.detach(), w.grad.clone()

    class EvictEverything:
        """Plans for budget 0 (a session plans a budget below the floor for the floor)."""

        def build(self, trace: ActivationTrace) -> ResidencySchedule:
            return get_planner("timed").build(dataclasses.replace(trace, memory_limit_bytes=0))

    expected = step(None)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0, planner=EvictEverything()))
    for _ in range(4):
        got = step(session)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    trace, schedule = session.trace, session.schedule
    sid_a = trace.guides[0].output_bindings[0]
    d2h = [i for i, _, a in schedule.actions()
           if a.storage_id == sid_a and a.kind is ResidencyActionType.COPY_D2H]
    assert len(d2h) >= 2, schedule.actions()
    assert session.last_report.bytes_d2h >= 2 * trace.storage_sizes[sid_a]
    assert held_while_evicted == [0, 0, 0, 0]  # the memory was really given back, in every phase


def test_host_pool_cap_keeps_storages_on_device_and_counts_it() -> None:
    model, reference = _mlp(), _mlp()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0, max_offload_activation_mb=0))
    for _ in range(3):
        assert _equal(_grads(model, _x(), session), _grads(reference, _x()))
        assert session.last_report.offload_cap_hits > 0
        assert session.last_report.bytes_d2h == 0


def test_gradient_accumulation_without_zero_grad_stays_correct() -> None:
    """Step 1 creates the grads, later steps add_ into them: a different op sequence once."""
    model, reference = _mlp(), _mlp()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    phases = []
    for step in range(5):
        with session:
            model(_x(seed=step)).square().sum().backward()
        reference(_x(seed=step)).square().sum().backward()
        phases.append((session.last_report.phase, session.last_report.diverged_at is not None))
        assert _equal([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])
    # The second step diverges where it adds into the grads, finishes online and traces
    # itself: from the third step on it replays its own plan.
    assert phases == [("warmup", False), ("replay", True), ("replay", False), ("replay", False),
                      ("replay", False)]


def test_an_intermediate_kept_only_at_replay_is_whole_after_the_step() -> None:
    """The trace saw it die; this step the user keeps it: the planned release must not lose it."""
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(8, 32), nn.Linear(32, 2)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    kept: list[torch.Tensor] = []

    def body(keep: bool) -> None:
        hidden = fc1(_x()).relu()  # saved for backward: moved out and back at budget 0
        fc2(hidden).square().sum().backward()
        if keep:
            kept.append(hidden)

    for step in range(3):
        fc1.zero_grad(set_to_none=True)
        fc2.zero_grad(set_to_none=True)
        with session:
            body(keep=step > 0)
        assert session.last_report.phase == ("warmup" if step == 0 else "replay")
    with torch.no_grad():
        expected = fc1(_x()).relu()
    relu = [op.name for op in session.trace.ops].index("aten.relu.default")
    sid = session.trace.guides[relu].output_bindings[0]
    assert sid in session.schedule.moved_sids() and sid not in session.trace.retained_sids
    assert all(torch.equal(k, expected) for k in kept)
