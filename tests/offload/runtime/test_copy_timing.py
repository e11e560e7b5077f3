"""Session steps under copies that complete at adversarial, seeded times: the chaos engine,
and the real ``StreamCopyEngine`` over fake CPU streams (on CUDA when there is one). Each
step must be bitwise equal to plain PyTorch, keep a feasible budget within replay's slack
(warmup, replay, and a replay at 2.7x the plan's length), and break no copy rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.runtime.chaos_copy_engine import ChaosCopyEngine
from hyperpar.offload.runtime.stream_copy_engine import StreamCopyEngine
from tests.offload.runtime.fake_streams import FakeStreams
from tests.step_context import step_context

MIB = 1 << 20
D = 64
SEEDS = range(6)


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(D, D, generator=g) / 8).requires_grad_() for _ in range(6)]


def _run(session: OffloadSession | None, length: int, ws: list[torch.Tensor], device: torch.device
         ) -> tuple[torch.Tensor, ...]:
    """Attention-like blocks (scores grow with the square of the length), one training step."""
    for w in ws:
        w.grad = None
    x = torch.randn(2, length, D, generator=torch.Generator().manual_seed(length)).to(device)
    with step_context(session):
        h = x
        for k in range(0, len(ws), 2):
            q = h @ ws[k]
            scores = (q @ q.transpose(1, 2)) / D
            h = torch.relu((scores.softmax(-1) @ q) @ ws[k + 1]) + h
        loss = h.square().mean()
        loss.backward()
    return (loss.detach(), *(w.grad.clone() for w in ws))  # type: ignore[union-attr]


def _session(budget: int, engine: Any, device: torch.device) -> OffloadSession:
    return OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, copy_engine=engine,
                                        device=str(device)))


def _check_engine(make_engine: Callable[[], Any], device: torch.device) -> Any:
    torch.set_num_threads(1)
    ws = [w.detach().to(device).requires_grad_() for w in _weights()]
    probe = _session(1 << 40, "sync", device)
    _run(probe, 256, ws, device)
    assert probe.last_report is not None
    budget = int(probe.last_report.peak_resident_bytes * 0.4)
    engine = make_engine()
    session = _session(budget, engine, device)
    for length, phase in ((96, "warmup"), (96, "replay"), (256, "replay"), (96, "replay")):
        expected, got = _run(None, length, ws, device), _run(session, length, ws, device)
        report = session.last_report
        assert report is not None and report.phase == phase, report
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), report
        assert report.peak_resident_bytes <= budget * 1.05, f"length {length}: {report}"
        if length == 256:  # at 96 the budget holds everything
            assert report.bytes_d2h > 0, report  # the copies this is about happened
    return engine


@pytest.mark.parametrize("seed", SEEDS)
def test_chaos_engine_keeps_results_and_budget(seed: int) -> None:
    engine = _check_engine(lambda: ChaosCopyEngine(seed), torch.device("cpu"))
    assert engine.violations == []
    assert engine.copies > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_stream_engine_on_fake_streams_keeps_results_and_budget(seed: int) -> None:
    cpu = torch.device("cpu")
    backends: list[FakeStreams] = []

    def make() -> StreamCopyEngine:
        backends.append(FakeStreams(seed))
        return StreamCopyEngine(cpu, backend=backends[-1])

    _check_engine(make, cpu)
    assert backends[0].violations == []
    assert backends[0].copies > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stream_engine_on_cuda_keeps_results_and_budget() -> None:
    cuda = torch.device("cuda", torch.cuda.current_device())
    _check_engine(lambda: StreamCopyEngine(cuda), cuda)
