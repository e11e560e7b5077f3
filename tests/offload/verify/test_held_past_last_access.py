"""Storages that Python holds past their last access (a local variable, a list of
intermediate outputs) and that the warmup had to move off: the plan counts them gone after
that access, so replay must take them off the device there too, or every replay runs over
the budget by their bytes while its report says the budget was feasible."""

from __future__ import annotations

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.step_context import step_context

MIB = 1 << 20


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(64, 64, generator=g) / 8).requires_grad_() for _ in range(6)]


def _step(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    held = []  # each layer's matmul output, alive until the step returns, never read again
    h = x
    for w in ws:
        a = h @ w
        held.append(a)
        h = torch.relu(a + 1.0)  # ``add`` saves nothing: ``a``'s last access
    loss = h.square().mean()
    loss.backward()
    return loss.detach()


def _run(session: OffloadSession | None, x: torch.Tensor, ws: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    for w in ws:
        w.grad = None
    with step_context(session):
        loss = _step(x, ws)
    return (loss, *(w.grad.clone() for w in ws))  # type: ignore[union-attr]


@pytest.mark.parametrize("fraction", [0.35, 0.5])
def test_replay_keeps_the_budget_with_storages_held_past_their_last_access(fraction: float) -> None:
    torch.set_num_threads(1)
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))
    ws = _weights()
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=float(1 << 20)))
    _run(probe, x, ws)
    assert probe.last_report is not None
    budget = int(probe.last_report.peak_resident_bytes * fraction)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    expected = _run(None, x, ws)
    phases = []
    for _ in range(3):
        got = _run(session, x, ws)
        report = session.last_report
        assert report is not None
        phases.append(report.phase)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), report
        floor = report.min_feasible_budget_bytes
        assert floor is not None and floor <= budget, report
        assert report.peak_resident_bytes <= budget * 1.05, report
    assert phases == ["warmup", "replay", "replay"]


def test_a_moved_storage_leaves_the_device_when_python_lets_go_of_it() -> None:
    """The thread copy engine keeps a finished copy's tensors until the compute thread polls
    it; replay polls right after a moved storage's recorded death, or the storage would stay
    on the device past it (HF Llama at 40 %: 1.13x the budget)."""
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 144), generator=torch.Generator().manual_seed(0))

    def step(session: OffloadSession) -> None:
        with session:
            model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=float(1 << 20)))
    step(probe)
    assert probe.last_report is not None
    budget = int(probe.last_report.peak_resident_bytes * 0.4)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    for _ in range(4):
        step(session)
        report = session.last_report
        assert report is not None and report.diverged_at is None, report
        assert report.peak_resident_bytes <= budget * 1.05, report
