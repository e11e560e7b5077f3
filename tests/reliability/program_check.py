"""Run a random program (tests/reliability/random_programs.py) plain and under offload, step by
step, and demand bitwise equality of the loss, every gradient and everything the program read
behind the dispatcher; or, when autograd rejects the program, the same error and nothing held."""

from __future__ import annotations

import copy

import numpy as np
import torch
from hypothesis import strategies as st

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.reliability.bitwise import same_bits
from tests.reliability.random_programs import VARYING_KINDS, B, D, Instr, RandomProgram
from tests.step_context import step_context

MIB = 1 << 20
STEPS = 3  # warmup and two replays
BUDGETS = st.sampled_from([0, 96, 512, 2048, 8192, 1 << 30])  # bytes; a [B, D] float32 is 128


def _step(model: RandomProgram, x: torch.Tensor, seed: int,
          session: OffloadSession | None) -> tuple[torch.Tensor | None, BaseException | None]:
    torch.manual_seed(seed)  # dropout: the same stream in both runs
    model.seen.clear()
    try:
        with step_context(session):
            loss = model(x)
            loss.backward()
    except RuntimeError as exc:
        return None, exc
    return loss.detach(), None


def _same_reads(a: list[object], b: list[object]) -> bool:
    """Bitwise: arrays by their bytes, lists and strings by repr (exact for floats)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray):
            if not (isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape
                    and x.tobytes() == y.tobytes()):
                return False
        elif repr(x) != repr(y):
            return False
    return True


def check_program(program: list[Instr], budget: int, planner: str = "greedy",
                  batches: tuple[int, ...] = (B,) * STEPS, accumulate: tuple[bool, ...] = ()) -> None:
    """With the default same-shaped batches every replay must match the trace (no divergence),
    unless the program has ``VARYING_KINDS`` (data-dependent storages or shapes); other
    ``batches`` force re-traces. ``accumulate[i]`` keeps the gradients of step i (no
    zero_grad), so the next backward accumulates into existing ``.grad`` tensors: a different
    op sequence (``add_`` instead of ``detach``), hence also a re-trace."""
    fixed = (len(set(batches)) == 1 and not any(accumulate[:len(batches) - 1])
             and not any(ins.kind in VARYING_KINDS for ins in program))
    torch.manual_seed(0)
    plain = RandomProgram(program)
    off = copy.deepcopy(plain)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, planner=planner,
                                           on_divergence="raise" if fixed else "retrace"))
    gen = torch.Generator().manual_seed(1)
    for step, rows in enumerate(batches):
        where = f"step {step} (batches {batches}) at budget {budget} B"
        x = torch.randn(rows, D, generator=gen)
        loss_a, err_a = _step(plain, x.clone(), 100 + step, None)
        loss_b, err_b = _step(off, x.clone(), 100 + step, session)
        assert session.tracked_storages() == 0, where
        if err_a is not None or err_b is not None:
            assert err_a is not None and err_b is not None, f"{where}: plain {err_a!r}, offload {err_b!r}"
            # the same kind of error; the node named may differ inside an opaque region
            assert type(err_a) is type(err_b), f"{where}: plain {err_a!r}, offload {err_b!r}"
            assert str(err_a).split(":")[0] == str(err_b).split(":")[0], f"{where}: {err_a} / {err_b}"
            assert session.held_bytes() == 0, where
            return
        assert session.last_report is not None
        if fixed:
            assert session.last_report.phase == ("warmup" if step == 0 else "replay"), where
            assert session.last_report.diverged_at is None, where
        assert same_bits(loss_a, loss_b), f"{where}: loss {loss_a} != {loss_b}"
        assert _same_reads(plain.seen, off.seen), f"{where}: read {off.seen}, plain PyTorch {plain.seen}"
        for (name, pa), pb in zip(plain.named_parameters(), off.parameters(), strict=True):
            assert same_bits(pa.grad, pb.grad), f"{where}: grad of {name}"
        with torch.no_grad():
            for pa, pb in zip(plain.parameters(), off.parameters(), strict=True):
                if pa.grad is not None:
                    pa.sub_(0.05 * pa.grad)
                    pb.sub_(0.05 * pb.grad)
        if step < len(accumulate) and accumulate[step]:
            continue
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)
