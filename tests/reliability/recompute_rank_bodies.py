"""Rank bodies: FSDP2, DDP and tensor-parallel steps with ``recompute="layers"`` beside offload,
plain and inside an OffloadSession, and a rank that fails inside a rebuilt call's backward."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.step_context import step_context

MIB = 1 << 20
WIDTH = 32


class Block(nn.Module):
    """A residual MLP block; ``fail_on`` (set by the failing-rank body) raises on that call of
    the step: the second call of a rebuilt step is the one backward makes."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.calls = 0
        self.fail_on: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError(f"injected failure in call {self.calls} of the step (backward's rebuild)")
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)], nn.Linear(WIDTH, 8))


def _wrap(kind: str) -> nn.Module:
    model = _model()
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in list(model)[:4]:
            fully_shard(block)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _blocks(model: nn.Module) -> list[Block]:
    return [m for m in model.modules() if isinstance(m, Block)]


Build = Callable[[], nn.Module]


def _train(build: Build, seed: Callable[[int], int], session: OffloadSession | None, steps: int
           ) -> tuple[list[list[torch.Tensor]], list[dict[str, Any]]]:
    """SGD steps; per step the loss and every local gradient (FSDP2, TP: the rank's shard)."""
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results, reports = [], []
    for step in range(steps):
        x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(seed(step)))
        with step_context(session):
            loss = model(x).square().mean()
            loss.backward()
        results.append([loss.detach().clone()] + [_local(p.grad) for p in model.parameters()])
        if session is not None:
            assert session.last_report is not None
            reports.append(session.last_report.as_dict())
        optimizer.step()
        optimizer.zero_grad()
    return results, reports


def _peak(build: Build, seed: Callable[[int], int]) -> int:
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e9))
    _train(build, seed, probe, steps=2)
    assert probe.last_report is not None
    return probe.last_report.peak_resident_bytes  # a steady step (FSDP2 initialises in the first)


def _rebuilt_against_plain(build: Build, seed: Callable[[int], int], fraction: float, steps: int
                           ) -> dict[str, Any]:
    """Per step whether loss and local gradients with ``recompute="layers"`` at ``fraction`` of
    the peak are bitwise the plain run's, each step's report and what the session chose."""
    budget = int(fraction * _peak(build, seed))
    expected, _ = _train(build, seed, None, steps)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, recompute="layers"))
    got, reports = _train(build, seed, session, steps)
    choice = session._recompute_choice
    return {"equal": [all(torch.equal(a, b) for a, b in zip(e, g, strict=True))
                      for e, g in zip(expected, got, strict=True)],
            "reports": reports, "budget": budget, "why": None if choice is None else choice.why,
            "names": None if session._recompute is None else list(session._recompute.names)}


def _per_rank(rank: int) -> Callable[[int], int]:
    return lambda step: 100 * step + rank


def recompute_matches_plain(rank: int, world: int, kind: str, fraction: float, steps: int) -> dict[str, Any]:
    """FSDP2 or DDP: per step whether loss and local gradients are bitwise the plain run's, each
    step's report and what the session chose to rebuild."""
    return _rebuilt_against_plain(lambda: _wrap(kind), _per_rank(rank), fraction, steps)


def _tp_model(mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model()
    for block in list(model)[:4]:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def tensor_parallel_recompute_matches_plain(rank: int, world: int, fraction: float, steps: int
                                            ) -> dict[str, Any]:
    """Tensor parallelism (the blocks' linears column- and row-wise: DTensor activations inside
    each block): per step bitwise equality of loss and local gradients, reports, the choice."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return _rebuilt_against_plain(lambda: _tp_model(mesh), lambda step: step, fraction, steps)


def rank_fails_in_rebuilt_backward(rank: int, world: int, kind: str, bad: int, fail_step: int
                                   ) -> dict[str, Any]:
    """Rebuilt steps of FSDP2 or DDP; at ``fail_step`` rank ``bad``'s last block raises when
    backward runs it again (its second call of the step), between collectives the other rank
    waits on. Each rank returns how its step ended (the error text, or that it completed), in
    how many seconds, and whether its session let go of everything and its modules got their
    own ``forward`` back."""
    model = _wrap(kind)
    peak = _peak(lambda: _wrap(kind), _per_rank(rank))
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=int(0.5 * peak) / MIB,
                                           recompute="layers"))
    out: dict[str, Any] = {"rebuilt": [], "error": None}
    for step in range(fail_step + 1):
        blocks = _blocks(model)
        for block in blocks:
            block.calls = 0
        if rank == bad and step == fail_step:
            blocks[-1].fail_on = 2
        x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(_per_rank(rank)(step)))
        start = time.monotonic()
        try:
            with session:
                model(x).square().mean().backward()
        except Exception as exc:  # the outcome is the result
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["step"], out["seconds"] = step, time.monotonic() - start
            break
        assert session.last_report is not None
        out["rebuilt"].append(session.last_report.bytes_recomputed > 0)
        out["step"], out["seconds"] = step, time.monotonic() - start
    out["applied"] = session._recompute_applied  # the last step ran with the chosen calls rebuilt
    out["calls"] = [b.calls for b in _blocks(model)]
    out["tracked"] = session.tracked_storages()
    out["forward_restored"] = all("forward" not in m.__dict__ for m in model.modules())
    return out
