"""A session's plan (packed schedule, replay program, prediction) is the same, array for array,
with the fast emitter and simulator as with the plain reference ones, on real steps: many
tiny ops, and a small GPT."""

from __future__ import annotations

import dataclasses
from array import array
from typing import Any

import pytest
import torch

from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.planning import greedy, prediction, timed
from tests.offload.planning.plan_reference import emit_reference, simulate_reference


def _tiny_ops(session: OffloadSession) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    ws = [torch.randn(4, generator=g).requires_grad_() for _ in range(60)]
    with session:
        for w in ws:
            x = torch.relu(x * w + 1.0)
        x.sum().backward()


def _gpt(session: OffloadSession) -> None:
    cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=32, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(cfg)
    with session:
        model.loss(*random_batch(cfg, 4, torch.Generator().manual_seed(0))).backward()


def _recorded(step: Any) -> tuple[ActivationTrace, list[object]]:
    session = OffloadSession(OffloadConfig(max_resident_fraction=0.4))
    got: list[tuple[ActivationTrace, list[object]]] = []
    plan = session._plan

    def record(signature: int, trace: ActivationTrace, keys: list[object], structure: Any,
               *packed: Any) -> Any:
        got.append((trace, keys))
        return plan(signature, trace, keys, structure, *packed)

    session._plan = record  # type: ignore[method-assign]
    step(session)
    return got[0]


def _fields(plan: Any) -> dict[str, Any]:
    ps, program = plan.packed_schedule, plan.program
    names = ("start", "kind", "sid", "budget_bytes", "predicted_peak_bytes", "deficit_bytes", "deficit_op",
             "notes")
    out: dict[str, Any] = {f"schedule.{k}": getattr(ps, k) for k in names}
    for f in dataclasses.fields(program):
        if f.name not in ("packed", "prefix", "keys"):
            out[f"program.{f.name}"] = getattr(program, f.name)
    out["predicted_ms"] = plan.predicted_ms
    return {k: v.tobytes() if isinstance(v, array) else v for k, v in out.items()}


@pytest.mark.parametrize("step", [_tiny_ops, _gpt], ids=["tiny_ops", "gpt"])
@pytest.mark.parametrize("planner", ["timed", "greedy"])
def test_session_plan_same_with_the_reference_emitter_and_simulator(
        step: Any, planner: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    trace, keys = _recorded(step)
    session = OffloadSession(OffloadConfig(planner=planner))
    fast = _fields(session._plan(1, trace, keys, None))
    assert fast["schedule.sid"] and fast["program.act_sid"]  # something is moved

    used: list[str] = []

    def plain_emit(*args: Any, **kwargs: Any) -> Any:
        used.append("emit")
        return emit_reference(*args, **kwargs)

    def plain_simulate(trace: ActivationTrace, schedule: Any, arrays: Any = None) -> Any:
        used.append("simulate")
        return simulate_reference(trace, schedule)

    for module in (timed, greedy):
        monkeypatch.setattr(module, "emit_schedule", plain_emit)
    monkeypatch.setattr(prediction, "simulate", plain_simulate)
    monkeypatch.setattr("hyperpar.offload.planning.simulate", plain_simulate)
    assert _fields(session._plan(1, trace, keys, None)) == fast
    assert "emit" in used and "simulate" in used
