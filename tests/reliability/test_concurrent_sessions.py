"""Sessions on several threads at once (each its own model): the active session, the dispatch
mode and the copy engines are per thread or per session, so each stays bitwise equal."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.reliability.bitwise import same_bits
from tests.reliability.random_programs import B, D, Instr, RandomProgram

# no dropout: the global RNG is shared by the threads
PROGRAM = [Instr("linear", 0, 0, 0, 0), Instr("opaque", 2, 1, 0, 0), Instr("inplace_nograd", 3, 1, 0, 0),
           Instr("max_tuple", 5, 3, 0, 0), Instr("split_cat", 6, 0, 0, 0)]


Loss = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def _twin_steps(seed: int, model: torch.nn.Module, session: OffloadSession, x_of: Callable[[], torch.Tensor],
                loss_of: Loss, steps: int, problems: list[str]) -> None:
    """``steps`` steps of ``model`` plainly and of its twin in ``session``, on this thread; every
    loss, gradient and buffer that differs in a bit is a problem (buffers: BatchNorm's)."""
    twin = copy.deepcopy(model)
    for step in range(steps):
        x = x_of()
        loss_a = loss_of(model, x)
        loss_a.backward()
        with session:
            loss_b = loss_of(twin, x)
            loss_b.backward()
        if not same_bits(loss_a.detach(), loss_b.detach()):
            problems.append(f"thread {seed} step {step}: loss")
        for (name, pa), pb in zip(model.named_parameters(), twin.parameters(), strict=True):
            if not same_bits(pa.grad, pb.grad):
                problems.append(f"thread {seed} step {step}: grad of {name}")
        for (name, ba), bb in zip(model.named_buffers(), twin.buffers(), strict=True):
            if not same_bits(ba, bb):
                problems.append(f"thread {seed} step {step}: buffer {name}")
        model.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)


def _on_four_threads(train: Callable[[int, str, list[str]], None]) -> None:
    """``train(seed, engine, problems)`` on four threads at once (thread and sync engines)."""
    problems: list[str] = []
    threads = [threading.Thread(target=train, args=(seed, ("thread", "sync")[seed % 2], problems))
               for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a session thread hung"
    assert problems == []
    assert OffloadSession.get_active() is None


def _train(seed: int, engine: str, problems: list[str]) -> None:
    try:
        model = RandomProgram(PROGRAM)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=0, copy_engine=engine, verify=True))
        gen = torch.Generator().manual_seed(seed)
        _twin_steps(seed, model, session, lambda: torch.randn(B, D, generator=gen), lambda m, x: m(x), 6,
                    problems)
        if session.phase != "replay" or session.tracked_storages() != 0:
            problems.append(f"thread {seed}: phase {session.phase}, {session.tracked_storages()} tracked")
    except BaseException as exc:  # reported to the main thread
        problems.append(f"thread {seed}: {exc!r}")


def test_sessions_on_four_threads_at_once() -> None:
    _on_four_threads(_train)


class _NormBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.lin = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(torch.nn.functional.gelu(self.lin(self.norm(x))))


def _train_rebuilt(seed: int, engine: str, problems: list[str]) -> None:
    """Each thread its own blocks, rebuilt in backward beside offload; gradients and the
    BatchNorm buffers compared bit for bit with a plain twin on the same thread."""
    try:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[_NormBlock(64) for _ in range(4)])
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.05, recompute="layers",
                                               copy_engine=engine))
        gen = torch.Generator().manual_seed(seed)
        _twin_steps(seed, model, session, lambda: torch.randn(128, 64, generator=gen),
                    lambda m, x: m(x).square().mean(), 8, problems)
        report = session.last_report
        if report is None or report.bytes_recomputed == 0 or report.bytes_d2h == 0:
            problems.append(f"thread {seed}: not rebuilt and offloaded: {report}")
    except BaseException as exc:  # reported to the main thread
        problems.append(f"thread {seed}: {exc!r}")


def test_rebuilding_sessions_on_four_threads_at_once() -> None:
    """Recompute patches forward on each session's own module instances, per step: four
    threads rebuilding and offloading at once stay bitwise, buffers included."""
    _on_four_threads(_train_rebuilt)
