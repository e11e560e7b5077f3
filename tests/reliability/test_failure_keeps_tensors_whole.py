"""Issue 11, item 4 of its build list: a failure leaves every tensor the user kept whole.
``restore_all`` restores every storage it can and then raises one error naming each storage
that failed; after any exception inside a step, every kept tensor reads plain PyTorch's
values, and none is left over a 0-byte storage."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.runtime import (
    HostPool,
    ResidencyManager,
    RestoreError,
    SyncCopyEngine,
    ThreadCopyEngine,
)
from tests.reliability.bitwise import same_bits
from tests.reliability.failure_cases import Injected, run_both
from tests.reliability.faulty_engine import FailingStorages
from tests.subprocess_harness import case_outcome

MIB = 1 << 20


def _engine(kind: str) -> SyncCopyEngine | ThreadCopyEngine:
    return SyncCopyEngine() if kind == "sync" else ThreadCopyEngine()


@pytest.mark.parametrize("lose_host_copy", [False, True])
@pytest.mark.parametrize("engine", ["sync", "thread"])
@pytest.mark.parametrize("failing", [(1,), (0, 2)])
def test_restore_all_restores_the_others_and_names_every_failure(engine: str, failing: tuple[int, ...],
                                                                 lose_host_copy: bool) -> None:
    """On main ``restore_all`` raised the first copy's own error, which names no storage.
    Now a copy the engine fails is retried without the engine, so nothing is lost while the
    host copy exists; when it does not, one ``RestoreError`` names every lost storage."""
    numels = (16, 24, 32, 40)  # distinct sizes: the engine fails by size
    tensors = [torch.arange(n, dtype=torch.float32) * (sid + 1) for sid, n in enumerate(numels)]
    expected = [t.clone() for t in tensors]
    inner = _engine(engine)
    try:
        m = ResidencyManager(torch.device("cpu"), HostPool(1 << 20),
                             FailingStorages(inner, {numels[sid] * 4 for sid in failing}))
        for sid, t in enumerate(tensors):
            entry = m.bind(sid, t.untyped_storage())
            assert m.copy_d2h(entry) and m.release_device(entry)
        m.wait_all()
        if lose_host_copy:
            for sid in failing:
                m.entries[sid].host = None  # as if the slab were gone
            with pytest.raises(RestoreError) as info:
                m.restore_all()
            message = str(info.value)
            for sid in failing:
                assert f"storage {sid}" in message, f"failed storage {sid} not named: {message!r}"
            assert sorted(e.sid for e, _ in info.value.lost) == sorted(failing)
        else:
            m.restore_all()
        for sid, (t, want) in enumerate(zip(tensors, expected, strict=True)):
            assert t.untyped_storage().nbytes() == want.numel() * 4, f"storage {sid} left at 0 bytes"
            if not (lose_host_copy and sid in failing):
                assert torch.equal(t, want), f"storage {sid} was not restored"
        assert m.evicted == {}
    finally:
        inner.close()


WIDTHS = (16, 24, 16, 16, 16, 16)  # the first layer's activations alone are [32, 24]
ODD_BYTES = 32 * 24 * 4


class _Chain(nn.Module):
    """The user keeps every activation; ``fail_at`` raises after that layer in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(WIDTHS))
        self.kept: list[torch.Tensor] = []
        self.fail_at = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h)) * 1.5
            self.kept.append(h)
            if i == self.fail_at:
                raise Injected(f"user error after layer {i}")
        return h.square().sum()


def _assert_kept_whole(plain: _Chain, off: _Chain, where: str,
                       unreadable: frozenset[int] = frozenset()) -> None:
    """Every tensor the offload run kept (a prefix of the plain run's when it failed early) is
    whole; those over a storage of an ``unreadable`` size may have lost their bytes."""
    assert len(off.kept) <= len(plain.kept), where
    for i, (a, b) in enumerate(zip(plain.kept, off.kept, strict=False)):
        need, has = b.numel() * b.element_size(), b.untyped_storage().nbytes()
        assert has >= need, f"{where}: kept tensor {i} over a {has}-byte storage (needs {need})"
        if has not in unreadable:
            assert same_bits(a, b), f"{where}: kept tensor {i} differs from plain PyTorch"


@pytest.mark.parametrize("engine", ["sync", "thread"])
@pytest.mark.parametrize("fail_at", [1, 3])
@pytest.mark.parametrize("budget", [0, 4096])
def test_exception_in_a_replay_step_keeps_every_kept_tensor(engine: str, fail_at: int, budget: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = _Chain()
    off = copy.deepcopy(plain)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, copy_engine=engine))
    for step in range(4):  # warmup, replays, the third one fails
        where = f"step {step}, failing after layer {fail_at}, budget {budget} B, {engine}"
        plain.fail_at = off.fail_at = fail_at if step == 2 else -1
        x = torch.randn(32, WIDTHS[0], generator=torch.Generator().manual_seed(step))
        a, b = run_both(plain, off, session, x)
        assert type(a) is type(b), f"{where}: plain {a!r}, offload {b!r}"
        assert len(plain.kept) == len(off.kept), where
        assert step != 2 or isinstance(b, Injected), where
        assert step == 2 or (session.last_report is not None and session.last_report.bytes_d2h > 0), where
        _assert_kept_whole(plain, off, where)
        assert session.tracked_storages() == 0, where
        for pa, pb in zip(plain.parameters(), off.parameters(), strict=True):
            assert same_bits(pa.grad, pb.grad), where
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)


@pytest.mark.parametrize("engine", ["sync", "thread"])
def test_a_storage_that_cannot_come_back_fails_the_step_and_nothing_else(engine: str) -> None:
    """Every H2D of one activation's storage fails in a replay step: the step raises, every
    other kept tensor reads plain PyTorch's values, none is left at 0 bytes, nothing stays
    held, and the next step (engine repaired) is bitwise right."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = _Chain()
    off = copy.deepcopy(plain)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0, copy_engine=engine))
    x = [torch.randn(32, WIDTHS[0], generator=torch.Generator().manual_seed(s)) for s in range(4)]
    run_both(plain, off, session, x[0])
    run_both(plain, off, session, x[1])
    real = session._manager.engine
    session._manager.engine = FailingStorages(real, {ODD_BYTES})  # the first layer's storages
    plain.zero_grad(set_to_none=True)
    off.zero_grad(set_to_none=True)
    a, b = run_both(plain, off, session, x[2])
    session._manager.engine = real
    assert a is None and isinstance(b, RuntimeError), f"plain {a!r}, offload {b!r}"
    assert session.tracked_storages() == 0 and session.held_bytes() == 0
    # the failed storages' bytes are lost, but each is allocated again (never 0 bytes)
    _assert_kept_whole(plain, off, "after the failed step", unreadable=frozenset({ODD_BYTES}))
    plain.zero_grad(set_to_none=True)
    off.zero_grad(set_to_none=True)
    assert run_both(plain, off, session, x[3]) == (None, None)
    _assert_kept_whole(plain, off, "the step after")
    for pa, pb in zip(plain.parameters(), off.parameters(), strict=True):
        assert same_bits(pa.grad, pb.grad)


@pytest.mark.parametrize("budget", ["0", "4 KiB"])
def test_exception_after_a_numpy_read_keeps_every_kept_tensor(budget: str) -> None:
    """Child interpreter: on main the ``.numpy()``-pinned storage failed its page-in, restore
    stopped there and the other kept tensors stayed at 0 bytes (reading one: SIGSEGV)."""
    case_outcome("tests.reliability.failure_cases", "cases", f"numpy then exception at budget {budget}")
