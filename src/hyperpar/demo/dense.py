"""The dense GPT runs of the demo: a plain baseline and the same steps under an OffloadSession.

Both runs build the model from the same seed and draw the same batches, so with offload
the losses and the final weights must come out bitwise equal to the baseline's.
"""

from __future__ import annotations

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


def measure_activation_peak(spec: DemoSpec) -> tuple[int, ActivationTrace]:
    """One traced step of a throwaway model with no budget: (peak activation bytes, trace)."""
    model = spec.build_model()
    (x, y), = spec.batches(1)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=float(1 << 30), device=spec.device))
    with session:
        model.loss(x, y).backward()
    assert session.last_report is not None and session.trace is not None
    return session.last_report.peak_resident_bytes, session.trace


def train_dense(
    spec: DemoSpec, steps: int, *, budget_bytes: int | None = None, planner: str = "timed",
    on_step: StepCallback | None = None,
) -> tuple[RunResult, GPT, OffloadSession | None]:
    """``budget_bytes=None``: plain PyTorch. Otherwise every step runs in one OffloadSession."""
    model = spec.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    session = None
    if budget_bytes is not None:
        config = OffloadConfig(max_resident_activation_mb=budget_bytes / MIB, device=spec.device,
                               planner=planner)
        session = OffloadSession(config)
    result = RunResult(name="baseline" if session is None else "offload", losses=[], step_ms=[])
    for step, (x, y) in enumerate(spec.batches(steps)):
        _sync(spec.device)
        t0 = time.perf_counter()
        if session is None:
            loss = model.loss(x, y)
            loss.backward()
        else:
            with session:
                loss = model.loss(x, y)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(spec.device)
        result.step_ms.append((time.perf_counter() - t0) * 1e3)
        result.losses.append(float(loss.item()))
        if session is not None and session.last_report is not None:
            result.reports.append(session.last_report.as_dict())
        if on_step is not None:
            on_step(step, result.losses[-1])
    if session is not None:
        _fill_offload_figures(result, session)
    return result, model, session


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
    if result.predicted_step_ms is None and session.trace is not None and session.schedule is not None:
        result.predicted_step_ms = simulate(session.trace, session.schedule).predicted_step_ms
        result.notes.append("predicted step time: simulate(trace, schedule) (the report had none)")
    if report.overshoot_bytes:
        result.notes.append(f"over budget by {report.overshoot_bytes} bytes at op {report.overshoot_op}")
    logger.info("offload run, last step: %s", report)


def planned_resident_bytes(session: OffloadSession) -> tuple[list[int], list[int]]:
    """Per op, from the session's trace: (without offload, with its schedule, simulated)."""
    if session.trace is None or session.schedule is None:
        return [], []
    plain = session.trace.resident_bytes_without_offload()
    planned = simulate(session.trace, session.schedule).resident_bytes
    return plain, list(planned)


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
