"""Reads that bypass the dispatcher (numpy, tolist, torch.save, repr) of activations inside a
session step, run in a child interpreter (see tests/subprocess_harness.py): on main they read
evicted storages, which returns garbage, raises, or crashes the interpreter.

The model reads an activation after enough later ops that every budget below the peak has
evicted it; the values read must equal those of the same step without a session, and an
array that shares memory with the activation must still hold them after the step."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from tests.offload.verify.lockstep import Lockstep, measured_peak, session_at
from tests.subprocess_harness import report_cases

ROWS = 64
FRACTIONS = (0.0, 0.5)


def _saved(t: torch.Tensor) -> bytes:
    """Loaded after the step (``_same``): ``torch.load`` inside a step is another matter."""
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


# name -> (reads the no-grad activation, read, whether the result shares memory with it)
READS: dict[str, tuple[bool, Callable[[torch.Tensor], Any], bool]] = {
    "detach_numpy": (False, lambda h: h.detach().numpy(), True),
    "numpy_no_grad": (True, lambda g: g.numpy(), True),
    "tolist": (False, lambda h: h.tolist(), False),
    "torch_save": (False, _saved, False),
    "repr_str": (False, lambda h: repr(h) + "\n" + str(h), False),
    "np_asarray": (False, lambda h: np.asarray(h.detach()), True),
}


class Reader(nn.Module):
    """``g`` (no grad) and ``h`` are produced first, read by the next ops, then idle for a
    while (evicted) when ``read`` looks at one of them."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        self.read = read
        self.seen: list[Any] = []  # what each step read, copied at once
        self.held: list[Any] = []  # what each step read, as returned (may share memory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            g = torch.tanh(self.l1(x))
        h = torch.tanh(self.l1(x)) * g
        k = torch.tanh(self.l2(h))
        for _ in range(3):
            k = torch.tanh(k * 1.5)
        no_grad, read, _ = READS[self.read]
        value = read(g if no_grad else h)
        self.held.append(value)
        self.seen.append(np.array(value, copy=True) if isinstance(value, np.ndarray) else
                         value.clone() if isinstance(value, torch.Tensor) else value)
        return self.l3(k).sum()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bytes):  # torch.save output
        return isinstance(b, bytes) and torch.equal(torch.load(io.BytesIO(a)), torch.load(io.BytesIO(b)))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def check_read(read: str, frac: float) -> None:
    def build() -> Reader:
        return Reader(read)

    gen = torch.Generator().manual_seed(3)
    peak = measured_peak(build, (torch.randn(ROWS, 8),))
    run = Lockstep(build, session_at(peak * frac))
    for step in range(3):  # warmup and two replays
        run.step(torch.randn(ROWS, 8, generator=gen), where=f"{read} at {frac:.0%}")
        plain, off = run.plain, run.off  # type: ignore[assignment]
        assert isinstance(plain, Reader) and isinstance(off, Reader)
        phase = run.reports[-1].phase
        assert _same(plain.seen[-1], off.seen[-1]), \
            f"step {step} ({phase}): {read} read {off.seen[-1]!r}, plain PyTorch {plain.seen[-1]!r}"
        if READS[read][2]:  # the array the user still holds shares memory with the activation
            assert _same(plain.held[-1], off.held[-1]), f"step {step}: the array kept past the step changed"
    assert run.reports[-1].phase == "replay"


def cases() -> None:
    report_cases({f"{read} at {frac}": (lambda r=read, f=frac: check_read(r, f))
                  for read in READS for frac in FRACTIONS})
