"""Faults inside ``with session:``: an exception (or KeyboardInterrupt) at a random place of a
warmup or replay, a failing copy, a host pool at its cap. Afterwards nothing is held, the
original exception object comes out, tensors the user kept are whole, and the next steps are
bitwise equal to the plain run."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.runtime import SyncCopyEngine
from tests.offload.verify.lockstep import sgd_and_zero
from tests.reliability.bitwise import same_bits
from tests.reliability.fault_models import WHERE, FaultyChain
from tests.reliability.faulty_engine import FaultyEngine

MIB = 1 << 20
WIDTH = 16
BUDGETS = st.sampled_from([0, 512, 4096, 1 << 30])


class InjectedBaseError(BaseException):
    """Not an Exception: like KeyboardInterrupt, it must pass through every handler."""


EXCEPTIONS: dict[str, Callable[[], BaseException]] = {
    "ValueError": lambda: ValueError("injected fault"),
    "KeyboardInterrupt": KeyboardInterrupt,
    "BaseException": lambda: InjectedBaseError("injected base fault"),
}


def _step(model: FaultyChain, x: torch.Tensor, session: OffloadSession | None,
          kept: list[torch.Tensor]) -> torch.Tensor:
    def body() -> torch.Tensor:
        kept.append(model.blocks[0](x) * 1.0)  # a tensor the user keeps past the step
        loss = model(x)
        loss.backward()
        return loss.detach()

    if session is None:
        return body()
    with session:
        return body()


def _assert_clean(session: OffloadSession, where: str) -> None:
    assert session.held_bytes() == 0, f"{where}: {session.held_bytes()} host bytes still held"
    assert session.tracked_storages() == 0, f"{where}: residency table not empty"
    assert OffloadSession.get_active() is None, where


def _compare(plain: FaultyChain, off: FaultyChain, a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    assert same_bits(a, b), f"{where}: loss"
    for (name, pa), pb in zip(plain.named_parameters(), off.parameters(), strict=True):
        assert same_bits(pa.grad, pb.grad), f"{where}: grad of {name}"
        assert same_bits(pa, pb), f"{where}: parameter {name}"


def run_with_fault(layers: int, budget: int, fail_step: int, inject: Callable[[FaultyChain, OffloadSession],
                   Any], disarm: Callable[[FaultyChain, OffloadSession], None], steps: int = 4,
                   **config: Any) -> None:
    """Steps of plain vs offload; at ``fail_step`` ``inject`` arms a fault on both models (returns
    the offload side's exception object, or None if it cannot fire in the plain run)."""
    torch.manual_seed(0)
    plain = FaultyChain(layers, WIDTH)
    off = copy.deepcopy(plain)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, **config))
    gen = torch.Generator().manual_seed(5)
    clean_steps = 0
    for step in range(steps):
        where = f"step {step} (fault at {fail_step}), budget {budget} B"
        x = torch.randn(3, WIDTH, generator=gen)
        kept_a: list[torch.Tensor] = []
        kept_b: list[torch.Tensor] = []
        if step != fail_step:
            a = _step(plain, x, None, kept_a)
            b = _step(off, x, session, kept_b)
            assert session.last_report is not None
            assert session.last_report.phase == ("warmup" if clean_steps == 0 else "replay"), where
            _compare(plain, off, a, b, where)
            assert same_bits(kept_a[0], kept_b[0]), f"{where}: kept tensor"
            assert session.tracked_storages() == 0
            assert session.held_bytes() <= session.config.offload_cap_bytes, where
            clean_steps += 1
            sgd_and_zero(plain, off)
            continue
        phase_before = session.phase
        exc = inject(plain, session)
        plain_error: BaseException | None = None
        if plain.trigger.exc is not None:
            with pytest.raises(type(plain.trigger.exc)):
                _step(plain, x, None, kept_a)
        off.trigger.exc, off.trigger.where, off.trigger.layer = (
            exc if plain.trigger.exc is not None else None, plain.trigger.where, plain.trigger.layer)
        loss_b: torch.Tensor | None = None
        try:
            loss_b = _step(off, x, session, kept_b)
        except BaseException as raised:  # KeyboardInterrupt is one of the faults
            plain_error = raised
        disarm(plain, session)
        off.trigger.exc = plain.trigger.exc = None
        fired = plain_error is not None
        if exc is not None and fired:
            assert plain_error is exc, f"{where}: raised {plain_error!r}, not the original {exc!r}"
        elif exc is not None and off.trigger.where:  # a model fault always fires
            raise AssertionError(f"{where}: the injected {exc!r} did not come out of the session")
        if fired:
            _assert_clean(session, where)
            assert session.phase == phase_before, where
            for t in kept_b:  # a 0-byte storage under a tensor the user holds reads out of bounds
                assert t.untyped_storage().nbytes() >= t.numel() * t.element_size(), \
                    f"{where}: a kept tensor was left with a {t.untyped_storage().nbytes()}-byte storage"
            if kept_b and kept_a:  # whatever the user kept before the fault is whole
                assert same_bits(kept_a[0], kept_b[0]), f"{where}: kept tensor"
            # the plain run saw the same partial step (or none, for a copy fault): start over equal
            with torch.no_grad():
                for pa, pb in zip(plain.parameters(), off.parameters(), strict=True):
                    pb.copy_(pa)
            plain.zero_grad(set_to_none=True)
            off.zero_grad(set_to_none=True)
        else:  # the copy fault had nothing to hit: an ordinary step, the plain model never ran it
            assert loss_b is not None
            a = _step(plain, x, None, kept_a)
            _compare(plain, off, a, loss_b, where)
            assert same_bits(kept_a[0], kept_b[0]), f"{where}: kept tensor"
            clean_steps += 1
            sgd_and_zero(plain, off)
    assert clean_steps >= 1


def _model_fault(where: str, layer: int, kind: str) -> tuple[Callable[..., Any], Callable[..., None]]:
    def inject(plain: FaultyChain, session: OffloadSession) -> BaseException:
        plain.trigger.exc, plain.trigger.where, plain.trigger.layer = EXCEPTIONS[kind](), where, layer
        return EXCEPTIONS[kind]()

    return inject, lambda plain, session: None


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(layers=st.integers(1, 4), data=st.data(), budget=BUDGETS, fail_step=st.integers(0, 2),
       where=st.sampled_from(WHERE), kind=st.sampled_from(sorted(EXCEPTIONS)))
def test_exception_at_a_random_place_of_warmup_or_replay(layers: int, data: st.DataObject, budget: int,
                                                         fail_step: int, where: str, kind: str) -> None:
    layer = data.draw(st.integers(0, layers - 1), label="layer")
    inject, disarm = _model_fault(where, layer, kind)
    run_with_fault(layers, budget, fail_step, inject, disarm)


def _copy_fault(direction: str, fail_at: int, kind: str,
                mode: str) -> tuple[Callable[..., Any], Callable[..., None]]:
    def inject(plain: FaultyChain, session: OffloadSession) -> BaseException | None:
        exc = EXCEPTIONS[kind]()
        session._manager.engine = FaultyEngine(session._manager.engine, direction, fail_at, mode, exc)
        return exc if mode == "submit" else None  # in flight: the engine reports its own error

    def disarm(plain: FaultyChain, session: OffloadSession) -> None:
        engine = session._manager.engine
        if isinstance(engine, FaultyEngine):
            session._manager.engine = engine.inner

    return inject, disarm


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(layers=st.integers(1, 3), budget=st.sampled_from([0, 512]), fail_step=st.integers(0, 2),
       direction=st.sampled_from(["d2h", "h2d"]), fail_at=st.integers(0, 12),
       kind=st.sampled_from(sorted(EXCEPTIONS)), mode=st.sampled_from(["submit", "inflight"]),
       engine=st.sampled_from(["thread", "sync"]))
def test_a_failing_copy(layers: int, budget: int, fail_step: int, direction: str, fail_at: int,
                        kind: str, mode: str, engine: str) -> None:
    """A copy that cannot start, or that fails where it runs: an error comes out of the step
    (never silently wrong bytes), nothing is held, and the next steps are bitwise right."""
    inject, disarm = _copy_fault(direction, fail_at, kind, mode)
    run_with_fault(layers, budget, fail_step, inject, disarm, copy_engine=engine)


class _BrokenH2D(SyncCopyEngine):
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Event | None:
        raise RuntimeError("device lost")


def test_every_copy_failing_leaves_no_zero_byte_storage() -> None:
    """Regression (found here, fixed in the async runtime): ``restore_all`` stopped at its first
    failing copy and the session then forgot the table, so a tensor the user kept stayed over a
    0-byte storage and reading it crashed the interpreter (SIGSEGV). Data may be lost, but every
    storage must be allocated again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    session._manager.engine = _BrokenH2D()
    x0, x1 = torch.randn(3, 16), torch.randn(3, 16)
    kept: list[torch.Tensor] = []
    with pytest.raises(RuntimeError, match="device lost"), session:
        kept.append(model[0](x0))
        kept.append(model[2](x0) * 2)  # both evicted at budget 0
        model(x1).sum().backward()  # needs a page-in: the copy fails
    _assert_clean(session, "after the failure")
    assert [t.untyped_storage().nbytes() for t in kept] == [192, 192]


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(layers=st.integers(1, 4), budget=BUDGETS, cap=st.integers(0, 6000), data=st.data())
def test_host_pool_at_its_cap(layers: int, budget: int, cap: int, data: st.DataObject) -> None:
    """Storages the pool cannot take stay on the device: correct, counted, never above the cap;
    a fault on top of it still frees everything."""
    fail_step = data.draw(st.sampled_from([None, 0, 1, 2]), label="fail_step")
    where = data.draw(st.sampled_from(WHERE), label="where")
    inject, disarm = _model_fault(where, data.draw(st.integers(0, layers - 1), label="layer"), "ValueError")
    run_with_fault(layers, budget, -1 if fail_step is None else fail_step, inject, disarm,
                   max_offload_activation_mb=cap / MIB)
