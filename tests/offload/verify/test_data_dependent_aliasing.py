"""Issue 11, item 1: which buffer an op writes or reads depends on the data; ops and shapes
stay the same. Replay must compare the storages each op really touches with the plan's,
report the difference as a divergence, finish the step bitwise right, and learn the
alternation so that it replays without divergence once the pattern repeats."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.offload.verify.aliasing_models import (
    ListOrderChoice,
    OptionalInput,
    OutputDtypeChoice,
    OutputRankChoice,
    ParameterOrActivation,
    ReadChoice,
    RegionWriteChoice,
    WriteChoice,
    choice_input,
)
from tests.offload.verify.lockstep import Lockstep, measured_peak, session_at

FRACTIONS = (0.0, 0.25, 0.5, 0.75)
REPLAY_LOGGER = "hyperpar.offload.capture.checked.replay"
STEPS = 10  # a, b, a, b, ...: the last SETTLED steps must replay a learned plan
SETTLED = 3


class _Divergences(logging.Handler):
    """The replay's divergence messages, in order (the session logs each one)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "diverged" in record.getMessage():
            self.messages.append(record.getMessage())


def check_alternation(model: type[nn.Module], frac: float, planner: str, engine: str,
                      why: str | None = None) -> None:
    """``why``: words the first divergence must give (which check saw the difference; a
    later op noticing a consequence instead would hide a check that failed to)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    peak = measured_peak(model, (choice_input(0, torch.Generator().manual_seed(1)),))
    run = Lockstep(model, session_at(peak * frac, planner=planner, copy_engine=engine))
    where = f"{model.__name__} at {frac:.0%} of {peak} B, {planner}, {engine}"
    seen = _Divergences()
    log = logging.getLogger(REPLAY_LOGGER)
    log.addHandler(seen)
    try:
        for step in range(STEPS):
            run.step(choice_input(step, gen), where=where)
    finally:
        log.removeHandler(seen)
    phases = [(r.phase, r.diverged_at) for r in run.reports]
    # Step 1 is the first to take the other branch and only step 0's plan exists: replaying
    # it must notice that the storages touched are not the planned ones.
    assert phases[1][1] is not None, \
        f"{where}: the step that touched another buffer was not reported as diverged: {phases}"
    if why is not None:
        assert seen.messages and why in seen.messages[0], \
            f"{where}: the first divergence should say {why!r}: {seen.messages[:1]}"
    assert phases[-SETTLED:] == [("replay", None)] * SETTLED, \
        f"{where}: the a/b alternation never settled into replays of learned plans: {phases}"


@pytest.mark.parametrize("engine", ["sync", "thread"])
@pytest.mark.parametrize("planner", ["greedy", "timed"])
@pytest.mark.parametrize("frac", FRACTIONS)
def test_data_dependent_write_target(frac: float, planner: str, engine: str) -> None:
    """Warmup writes ``b``, step 1 writes ``a``: on main ``a``'s host copy stayed "current" and
    its planned page-in brought back the bytes from before the write."""
    check_alternation(WriteChoice, frac, planner, engine)


@pytest.mark.parametrize("planner", ["greedy", "timed"])
@pytest.mark.parametrize("frac", FRACTIONS)
def test_data_dependent_read_source(frac: float, planner: str) -> None:
    check_alternation(ReadChoice, frac, planner, "thread")


@pytest.mark.parametrize("engine", ["sync", "thread"])
@pytest.mark.parametrize("frac", FRACTIONS)
def test_data_dependent_write_inside_skip_offload(frac: float, engine: str) -> None:
    """The region is one op to replay; which of its inputs it writes is still part of what
    replay must check."""
    check_alternation(RegionWriteChoice, frac, "greedy", engine)


@pytest.mark.parametrize("model", [ListOrderChoice, ParameterOrActivation, OptionalInput],
                         ids=lambda m: m.__name__)
@pytest.mark.parametrize("frac", (0.0, 0.5, 1.0))
def test_inputs_that_change_place(model: type[nn.Module], frac: float) -> None:
    """Replay checks positional tensor inputs in one pass and lists the general way; an
    input moved inside a list, a parameter read where the plan read an activation (or the
    reverse) and an optional tensor that comes and goes are all differences it must see.
    At the full peak the plan moves nothing, so every op can take replay's lean path."""
    check_alternation(model, frac, "greedy", "thread", why="its inputs are other storages")


@pytest.mark.parametrize("model", [OutputDtypeChoice, OutputRankChoice], ids=lambda m: m.__name__)
@pytest.mark.parametrize("frac", (0.0, 1.0))
def test_outputs_that_change_kind(model: type[nn.Module], frac: float) -> None:
    """An output of another dtype or rank from the planned op and inputs is a divergence. At
    the full peak (the plan moves nothing) the ops take replay's lean path, which checks an
    op's one output against a dtype and a rank column (without that check nothing notices
    at 1.0: checked)."""
    check_alternation(model, frac, "greedy", "thread", why="other output dtypes or ranks")
