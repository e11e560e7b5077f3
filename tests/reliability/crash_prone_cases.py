"""Programs that crashed the interpreter on main (issue 11), run in a child interpreter by
tests/reliability/test_crash_prone_programs.py: sparse tensors, whose values and indices the
dispatcher cannot page in, and a second thread reading an activation while a step runs."""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.offload.verify.lockstep import Lockstep, measured_peak, session_at
from tests.subprocess_harness import report_cases

EMBEDDING_FRACTIONS = (0.0, 0.1, 0.2, 0.5)
SPARSE_MM_FRACTIONS = (0.0, 0.5)
THREAD_READS = ("sum", "tolist")


class SparseEmbedding(nn.Module):
    """Its weight's gradient is a sparse COO tensor made inside the step."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16, sparse=True)
        self.lin = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(self.emb(ids))).square().sum()


class SparseFromActivations(nn.Module):
    """A COO matrix whose values (and, for ``nonzero``, indices) come from an activation,
    multiplied by a parameter with ``torch.sparse.mm`` (differentiable in both)."""

    def __init__(self, nonzero: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.nonzero = nonzero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.lin(x))
        if self.nonzero:  # data-dependent number of entries
            mask = a > 0
            coo = torch.sparse_coo_tensor(mask.nonzero().t(), a[mask], a.shape, check_invariants=True)
        else:
            vals, cols = a.topk(4, dim=1)
            rows = torch.arange(a.shape[0]).repeat_interleave(4)
            coo = torch.sparse_coo_tensor(torch.stack([rows, cols.flatten()]), vals.flatten(), a.shape,
                                          check_invariants=True)
        y = torch.sparse.mm(coo, self.w)
        return (torch.tanh(y) * a).sum()


def _train(build: Any, make_input: Any, frac: float, steps: int = 3) -> None:
    """Warmup and replays bitwise equal to plain PyTorch at ``frac`` of the measured peak."""
    gen = torch.Generator().manual_seed(0)
    peak = measured_peak(build, (make_input(torch.Generator().manual_seed(9)),))
    run = Lockstep(build, session_at(peak * frac))
    for _ in range(steps):
        run.step(make_input(gen), where=f"{build.__name__} at {frac:.0%} of {peak} B")


def _ids(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 64, (8, 12), generator=gen)


def _rows(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(32, 16, generator=gen)


def _sparse_mm(nonzero: bool) -> Any:
    def build() -> nn.Module:
        return SparseFromActivations(nonzero)

    build.__name__ = f"sparse.mm({'nonzero' if nonzero else 'topk'} COO)"
    return build


class _Logged(nn.Module):
    """Publishes its first activation where a logger thread can see it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.latest: tuple[int, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        self.latest = (step, h)
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        return h.sum()


def thread_reads(how: str, steps: int = 40) -> None:
    """A logger thread reads the activation (``how``: "sum" or "tolist") in a loop while steps
    run at budget 0. Every value it gets must be plain PyTorch's; an error is allowed only if
    it names the offload session (a crash fails the case)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: reads land in the middle of steps
    try:
        _thread_reads(how, steps)
    finally:
        sys.setswitchinterval(interval)


def _thread_reads(how: str, steps: int) -> None:

    def read(h: torch.Tensor) -> Any:
        return h.detach().sum().item() if how == "sum" else h.tolist()

    torch.manual_seed(0)
    plain = _Logged()
    off = _Logged()
    off.load_state_dict(plain.state_dict())
    xs = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(steps)]
    expected = []
    for i, x in enumerate(xs):
        plain(x, i).backward()
        plain.zero_grad(set_to_none=True)
        assert plain.latest is not None
        expected.append(read(plain.latest[1]))
    stop = threading.Event()
    got: list[tuple[int, Any]] = []
    errors: list[str] = []

    def logger() -> None:
        while not stop.is_set():
            latest = off.latest
            if latest is None:
                continue
            try:
                got.append((latest[0], read(latest[1])))
            except Exception as exc:  # allowed if it says why: the session holds the bytes
                errors.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=logger, daemon=True)
    thread.start()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    try:
        for i, x in enumerate(xs):
            with session:
                off(x, i).backward()
            off.zero_grad(set_to_none=True)
    finally:
        stop.set()
        thread.join(timeout=30)
    wrong = [(step, value, expected[step]) for step, value in got if value != expected[step]]
    assert not wrong, f"{len(wrong)} of {len(got)} reads from the logger thread were wrong, e.g. {wrong[0]}"
    unclear = sorted({e for e in errors if "offload" not in e.lower()})
    assert not unclear, f"errors that do not say the offload session is involved: {unclear[:3]}"
    assert got or errors, "the logger thread never ran"


def cases() -> None:
    named: dict[str, Any] = {}
    for frac in EMBEDDING_FRACTIONS:
        named[f"embedding at {frac}"] = lambda f=frac: _train(SparseEmbedding, _ids, f)
    for nonzero in (False, True):
        for frac in SPARSE_MM_FRACTIONS:
            named[f"sparse_mm nonzero={nonzero} at {frac}"] = \
                lambda n=nonzero, f=frac: _train(_sparse_mm(n), _rows, f)
    for how in THREAD_READS:
        named[f"logger thread {how}"] = lambda h=how: thread_reads(h)
    report_cases(named)
