"""The dense GPT runs of the demo: a plain baseline and the same steps under an OffloadSession.

Every run builds the model from the same seed and draws the same batches, so with offload
the losses and the final weights must come out bitwise equal to the baseline's, provided
plain PyTorch itself repeats bit for bit on this machine: the demo trains plain twice to
check that before it judges offload.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hyperpar.demo.results import RunResult
from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.planning import simulate

logger = logging.getLogger(__name__)
MIB = 1 << 20
StepCallback = Callable[[int, float], None]  # (step, loss)


@dataclass(frozen=True)
class DemoSpec:
    cfg: GPTConfig
    batch_size: int
    seed: int
    device: torch.device
    lr: float = 1e-3

    def build_model(self) -> GPT:
        torch.manual_seed(self.seed)
        return GPT(self.cfg).to(self.device)

    def batches(self, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed + 1)
        return [random_batch(self.cfg, self.batch_size, gen, self.device) for _ in range(steps)]


def _sync(device: torch.device) -> None:
    if device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.synchronize()


@dataclass(frozen=True)
class ActivationPeak:
    """One unbudgeted step's peak and its split into movable and kept bytes: a fraction's
    budget is made of the split (as ``OffloadConfig.max_resident_fraction`` makes it), not
    of the whole peak, so that parameter gradients are not counted as activations."""

    peak_bytes: int  # resident bytes at the step's peak, kept ones included
    movable_peak_bytes: int  # the peak of the bytes not kept past the step
    kept_bytes: int  # parameter gradients, the loss, outputs: they stay whatever the plan
    trace: ActivationTrace

    def budget(self, fraction: float) -> int:
        """What ``OffloadConfig(max_resident_fraction=fraction)`` resolves to on this step."""
        config = OffloadConfig(max_resident_fraction=fraction)
        return config.budget_for_peak(self.movable_peak_bytes, self.kept_bytes)


def measure_activation_peak(spec: DemoSpec) -> ActivationPeak:
    """One traced step of a throwaway model with no budget: its peak, split, and its trace."""
    model = spec.build_model()
    (x, y), = spec.batches(1)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=float(1 << 30), device=spec.device))
    with session:
        model.loss(x, y).backward()
    report = session.last_report
    assert report is not None and session.trace is not None
    assert report.movable_peak_bytes is not None and report.kept_bytes is not None  # set on every plan
    return ActivationPeak(report.peak_resident_bytes, report.movable_peak_bytes, report.kept_bytes,
                          session.trace)


class _DenseRun:
    """One model, its optimizer and, for an offload run, the session its steps run in."""

    def __init__(self, spec: DemoSpec, name: str, budget_bytes: int | None, planner: str) -> None:
        self.spec = spec
        self.model = spec.build_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.lr)
        self.session = None
        if budget_bytes is not None:
            self.session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget_bytes / MIB,
                                                        device=spec.device, planner=planner))
        self.result = RunResult(name=name, losses=[], step_ms=[])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One training step; wall and CPU time cover forward, backward and the optimizer."""
        _sync(self.spec.device)
        t0, c0 = time.perf_counter(), time.process_time()
        with self.session if self.session is not None else contextlib.nullcontext():
            loss = self.model.loss(x, y)
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _sync(self.spec.device)
        self.result.step_cpu_ms.append((time.process_time() - c0) * 1e3)
        self.result.step_ms.append((time.perf_counter() - t0) * 1e3)
        self.result.losses.append(float(loss.item()))
        if self.session is not None and self.session.last_report is not None:
            self.result.reports.append(self.session.last_report.as_dict())

    def finish(self) -> None:
        if self.session is not None:
            _fill_offload_figures(self.result, self.session)


def train_dense(
    spec: DemoSpec, steps: int, *, budget_bytes: int | None = None, planner: str = "timed",
    on_step: StepCallback | None = None,
) -> tuple[RunResult, GPT, OffloadSession | None]:
    """``budget_bytes=None``: plain PyTorch. Otherwise every step runs in one OffloadSession."""
    run = _DenseRun(spec, "baseline" if budget_bytes is None else "offload", budget_bytes, planner)
    for step, (x, y) in enumerate(spec.batches(steps)):
        run.step(x, y)
        if on_step is not None:
            on_step(step, run.result.losses[-1])
    run.finish()
    return run.result, run.model, run.session


@dataclass
class SideBySide:
    """The demo's three dense runs, trained step by step in turn."""

    baseline: RunResult
    repeat: RunResult  # plain PyTorch again: does it reproduce the baseline bit for bit?
    offload: RunResult
    models: dict[str, GPT]  # by run name
    session: OffloadSession


def train_side_by_side(
    spec: DemoSpec, steps: int, *, budget_bytes: int, planner: str = "timed",
    on_step: StepCallback | None = None,
) -> SideBySide:
    """Plain, plain again and offload, one step of each in turn (the first of each step
    rotates), so that a busy machine slows all three alike and the plain run's own
    repeatability is checked on the same batches. ``on_step`` gets the baseline's loss."""
    runs = [_DenseRun(spec, "baseline", None, planner), _DenseRun(spec, "offload", budget_bytes, planner),
            _DenseRun(spec, "repeat", None, planner)]
    for step, (x, y) in enumerate(spec.batches(steps)):
        for k in range(len(runs)):
            runs[(step + k) % len(runs)].step(x, y)
        if on_step is not None:
            on_step(step, runs[0].result.losses[-1])
    for run in runs:
        run.finish()
    base, off, again = runs
    assert off.session is not None
    return SideBySide(baseline=base.result, repeat=again.result, offload=off.result,
                      models={r.result.name: r.model for r in runs}, session=off.session)


def _fill_offload_figures(result: RunResult, session: OffloadSession) -> None:
    report = session.last_report
    if report is None:
        return
    result.peak_activation_bytes = max(r["peak_resident_bytes"] for r in result.reports[1:] or result.reports)
    result.budget_bytes = report.budget_bytes
    result.bytes_moved_per_step = report.bytes_d2h + report.bytes_h2d
    result.demand_faults = report.demand_faults
    result.exposed_wait_ms = report.exposed_wait_ms
    result.predicted_step_ms = report.predicted_step_ms
    result.min_feasible_budget_bytes = report.min_feasible_budget_bytes
    result.fast_path_floor_bytes = report.fast_path_floor_bytes
    if result.predicted_step_ms is None and session.trace is not None and session.schedule is not None:
        result.predicted_step_ms = simulate(session.trace, session.schedule).predicted_step_ms
        result.notes.append("predicted step time: simulate(trace, schedule) (the report had none)")
    if report.overshoot_bytes:
        floor = report.min_feasible_budget_bytes
        why = (f": the budget is below the feasible floor of {floor / MIB:.2f} MiB, which no schedule can "
               f"go under" if floor is not None and floor > report.budget_bytes else "")
        result.notes.append(f"over budget by {report.overshoot_bytes / MIB:.2f} MiB at op "
                            f"{report.overshoot_op}{why}")
    logger.info("offload run, last step: %s", report)


def planned_resident_bytes(session: OffloadSession) -> tuple[list[int], list[int]]:
    """Per op, from the session's trace: (without offload, with its schedule, simulated)."""
    if session.trace is None or session.schedule is None:
        return [], []
    plain = session.trace.resident_bytes_without_offload()
    planned = simulate(session.trace, session.schedule).resident_bytes
    return plain, list(planned)


def run_differences(runs: SideBySide, a: str, b: str) -> list[str]:
    """What differs between two of the runs, losses then final weights; empty: bitwise equal."""
    first, second = (getattr(runs, name) for name in (a, b))
    return (loss_differences(first.losses, second.losses)
            + weight_differences(runs.models[first.name], runs.models[second.name]))


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return not weight_differences(a, b)


def weight_differences(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """One line per parameter that is not bitwise equal (name and largest difference)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if pa.keys() != pb.keys():
        return [f"parameter names differ: {sorted(pa.keys() ^ pb.keys())}"]
    return [f"{k}: max |diff| {(pa[k].detach() - pb[k].detach()).abs().max().item():.3e}"
            for k in pa if not torch.equal(pa[k], pb[k])]


def loss_differences(a: list[float], b: list[float]) -> list[str]:
    if len(a) != len(b):
        return [f"step counts differ: {len(a)} vs {len(b)}"]
    return [f"step {i}: {x!r} ({x.hex()}) vs {y!r} ({y.hex()})"
            for i, (x, y) in enumerate(zip(a, b, strict=True)) if x.hex() != y.hex()]
