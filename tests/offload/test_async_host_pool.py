"""The session's host pool: no new host allocation from the second replay on, and a cap that
keeps storages on the device (counted) instead of failing the step."""

from __future__ import annotations

import copy

import torch

from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession

MIB = 1 << 20


def _setup() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = GPTConfig.tiny()
    return GPT(cfg), random_batch(cfg, 2, torch.Generator().manual_seed(0))


def _step(model: GPT, batch: tuple[torch.Tensor, torch.Tensor],
          session: OffloadSession | None) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    if session is None:
        loss = model.loss(*batch)
        loss.backward()
    else:
        with session:
            loss = model.loss(*batch)
            loss.backward()
    return loss.detach()


def test_no_new_host_allocation_from_the_second_replay_on() -> None:
    model, batch = _setup()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0, device="cpu"))
    allocations = []
    for _ in range(5):
        _step(model, batch, session)
        allocations.append(session.host_allocations())
    assert session.last_report is not None and session.last_report.bytes_d2h > 0
    assert allocations[1] > 0
    assert allocations[2:] == [allocations[1]] * 3, allocations  # replay 2, 3, 4 allocate nothing


def test_pool_at_its_cap_keeps_storages_on_device_and_the_step_correct() -> None:
    model, batch = _setup()
    plain = copy.deepcopy(model)
    cap_mb = 0.01
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0, max_offload_activation_mb=cap_mb,
                                           device="cpu"))
    for step in range(3):
        expected = _step(plain, batch, None)
        got = _step(model, batch, session)
        assert torch.equal(expected, got), step
        for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), (step, name)
        report = session.last_report
        assert report is not None and report.offload_cap_hits > 0, step
        assert session.held_bytes() <= cap_mb * MIB
