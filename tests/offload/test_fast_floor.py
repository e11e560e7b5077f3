"""The fast-path floor (issue 40): the least budget a plan the fast path can run meets, beside
the general floor, reported from the first checked replay on; budgets at or above it run fast
from the second replay, budgets between the two floors keep the budget on the checked replay
and say so once."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.planning.arrays import trace_arrays, with_reads
from tests.offload.test_fast_replay import MIB

# the planner's link fixed: these tests assert which path a plan takes (see conftest)
pytestmark = pytest.mark.usefixtures("steady_link")

LAYERS = 12


class HeldAcross(torch.nn.Module):
    """A tensor no op saves for backward (a product by a Python number), held by Python
    across the whole forward: the dispatch mode can move it, the fast path cannot."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = x * 2.0
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h.sum() + keep.sum()


def _peak(model: torch.nn.Module, x: torch.Tensor) -> int:
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6))
    with probe:
        model(x).backward()
    assert probe.last_report is not None
    return probe.last_report.peak_resident_bytes


def _steps(fraction: float, steps: int = 5) -> tuple[OffloadSession, list[str | None], int]:
    """Steps of ``HeldAcross`` at ``fraction`` of its peak, each bitwise against plain and
    within the budget where the budget is at or above the floor."""
    torch.set_num_threads(1)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    plain, off = HeldAcross(), HeldAcross()
    budget = int(_peak(off, x) * fraction)
    off.zero_grad(set_to_none=True)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, planner="greedy"))
    paths = []
    for _ in range(steps):
        plain(x).backward()
        with session:
            off(x).backward()
        report = session.last_report
        assert report is not None
        if report.min_feasible_budget_bytes is not None and report.min_feasible_budget_bytes <= budget:
            assert report.peak_resident_bytes <= budget, report
        paths.append(report.replay_path)
        for a, b in zip(plain.parameters(), off.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), report
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)
    return session, paths, budget


def test_the_fast_path_floor_is_reported_from_the_first_checked_replay() -> None:
    session, paths, _ = _steps(0.5, steps=2)
    report = session.last_report
    assert report is not None and paths == [None, "checked"]
    general, fast = report.min_feasible_budget_bytes, report.fast_path_floor_bytes
    assert general is not None and fast is not None
    # the held tensor is movable by the mode only: the fast path's floor is above the general one
    assert general < fast < report.budget_bytes * 2
    assert f"fast-path floor {fast / MIB:.1f} MiB" in str(report)


def test_budgets_at_or_above_the_fast_path_floor_run_fast_from_the_second_replay() -> None:
    probe, _, _ = _steps(0.5, steps=2)
    assert probe.last_report is not None and probe.last_report.fast_path_floor_bytes is not None
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    fraction = probe.last_report.fast_path_floor_bytes * 1.2 / _peak(HeldAcross(), x)
    session, paths, budget = _steps(fraction)
    own = session.last_report
    assert own is not None and own.fast_path_floor_bytes is not None
    plans = [p for st in session._structures.values() for p in st.sizes.values()]
    assert paths == [None, "checked", "fast", "fast", "fast"], (
        paths, budget, own.fast_path_floor_bytes, probe.last_report.fast_path_floor_bytes,
        [(p.fast_refusal, p.refinements, p.packs is not None, p.program.planned_peak, p.floor.floor_bytes)
         for p in plans], own)
    assert all(p.refinements <= 1 for p in plans), [p.refinements for p in plans]  # one re-plan at most


def test_a_budget_between_the_floors_keeps_it_checked_and_says_so_once(caplog: pytest.LogCaptureFixture
                                                                        ) -> None:
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    probe, _, _ = _steps(0.5, steps=2)
    report = probe.last_report
    assert report is not None and report.fast_path_floor_bytes and report.min_feasible_budget_bytes
    between = (report.min_feasible_budget_bytes + report.fast_path_floor_bytes) / 2
    with caplog.at_level(logging.WARNING, logger="hyperpar.offload.api.session"):
        _, paths, _ = _steps(between / _peak(HeldAcross(), x))
    assert paths == [None] + ["checked"] * 4, paths
    said = [r.getMessage() for r in caplog.records if "fast path's floor" in r.getMessage()]
    assert len(said) == 1, said
    assert f"{report.fast_path_floor_bytes / MIB:.2f} MiB" in said[0]
    assert f"any plan: {report.min_feasible_budget_bytes / MIB:.2f} MiB" in said[0]


def test_with_reads_adds_reads_in_op_order_within_each_storage_life() -> None:
    """The spans Python held a storage become reads a plan must respect; none may bring a
    storage to life early or name one the trace never touched."""
    from hyperpar.offload.ir import AccessKind, ActivationTrace, StorageAccess, TraceOp

    def op(i: int, *sids: int) -> TraceOp:
        return TraceOp("aten.op", 1.0, tuple(StorageAccess(i, s, AccessKind.READ) for s in sids))

    trace = ActivationTrace(ops=[op(0, 1), op(1, 2), op(2, 2), op(3, 1)], storage_sizes={1: 8, 2: 8},
                            memory_limit_bytes=1 << 20, d2h_bandwidth_gbps=1.0, h2d_bandwidth_gbps=1.0)
    arr = trace_arrays(trace)
    read = with_reads(arr, np.array([1, 2, 9]), np.array([1, 1, 2]))  # op 9: outside storage 2's life
    assert read.access_op.tolist() == [0, 1, 1, 2, 2, 3]
    assert read.access_sid.tolist() == [1, 2, 1, 2, 1, 1]
    assert not read.access_write[[2, 4]].any()
    assert read.last_op.tolist() == arr.last_op.tolist()  # within their lives: nothing extended
    assert with_reads(arr, np.array([1]), np.array([7])) is arr  # a storage the trace never touches
    # where the op accesses it already, or twice over: one access (a working set counts it once)
    assert with_reads(arr, np.array([0, 1]), np.array([1, 2])) is arr
    twice = with_reads(arr, np.array([1, 1, 2]), np.array([1, 1, 1]))
    assert twice.access_op.tolist() == [0, 1, 1, 2, 2, 3] and twice.access_sid.tolist() == [1, 2, 1, 2, 1, 1]


def test_watching_what_python_holds_costs_linear_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first checked replay looks, at each forward event, only at storages Python held when
    last looked (and the new one): a step of n saved tensors makes O(n) looks, not O(n^2)
    (a 19k-op step's first checked replay took 7 s, 0.6 s since)."""
    from hyperpar.offload.capture.fast.fast_schedule import EventLog

    looks = [0]
    real = EventLog._python_holds

    def counted(self: EventLog, *args: object, **kwargs: object) -> bool:
        looks[0] += 1
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(EventLog, "_python_holds", counted)
    torch.set_num_threads(1)
    ws = [torch.randn(16, requires_grad=True) for _ in range(200)]
    h0 = torch.randn(8, 16)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6))
    for _ in range(2):  # warmup, then the checked replay that watches
        with session:
            h = h0
            for w in ws:
                h = torch.tanh(h * w)
            h.sum().backward()
        for w in ws:
            w.grad = None
    saved = 2 * len(ws)  # each layer saves w's other factor and tanh's output
    assert session.last_report is not None and session.last_report.replay_path == "checked"
    assert 0 < looks[0] < 5 * saved, looks[0]  # all storages at every event: ~saved^2 / 2 = 80,000
