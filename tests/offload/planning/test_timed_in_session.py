"""The timed planner's early prefetches replay correctly in a real session."""

from __future__ import annotations

import copy

import torch

from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession


def test_timed_plan_replays_bitwise_equal_within_budget() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig.tiny()
    model = GPT(cfg)
    x, y = random_batch(cfg, 2, torch.Generator().manual_seed(0))
    reference = copy.deepcopy(model)
    ref_loss = reference.loss(x, y)
    ref_loss.backward()
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1 << 20))
    with probe:
        copy.deepcopy(model).loss(x, y).backward()
    assert probe.trace is not None
    budget_mb = probe.trace.peak_bytes_without_offload() * 0.5 / (1 << 20)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget_mb, planner="timed"))
    for _ in range(3):
        model.zero_grad()
        with session:
            loss = model.loss(x, y)
            loss.backward()
        assert torch.equal(loss, ref_loss)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
    assert session.schedule is not None and session.schedule.planner == "timed"
    assert session.schedule.moved_sids()
    report = session.last_report
    assert report is not None and report.phase == "replay" and report.demand_faults == 0
    assert report.bytes_h2d > 0
