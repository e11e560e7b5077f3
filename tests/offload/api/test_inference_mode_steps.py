"""Steps run under ``torch.inference_mode()`` (an evaluation forward between training steps,
or a whole session step inside it). Tensors made in inference mode are inference tensors,
which torch refuses to update in place outside inference mode; the copy thread is never in
it, so the runtime's own byte views and host slabs must be normal tensors (before: the first
page-in of such a step raised "Inplace update to inference tensor outside InferenceMode")."""

from __future__ import annotations

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.step_context import step_context

MIB = 1 << 20


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(128, 128, generator=g) / 12).requires_grad_() for _ in range(6)]


def _forward(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """Every layer's output is held to the end and read there (as ``output_hidden_states``
    would), so a tight budget evicts them and pages them back in."""
    held = []
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
        held.append(h)
    return sum(t.square().mean() for t in held)


def _train(x: torch.Tensor, ws: list[torch.Tensor],
           session: OffloadSession | None) -> tuple[torch.Tensor, ...]:
    for w in ws:
        w.grad = None
    with step_context(session):
        loss = _forward(x, ws)
        loss.backward()
    return (loss.detach(), *(w.grad for w in ws))


@pytest.mark.parametrize("engine", ["thread", "sync"])
@pytest.mark.parametrize("order", ["session_outside", "session_inside"])
def test_evaluation_steps_in_inference_mode_between_training_steps(order: str, engine: str) -> None:
    torch.set_num_threads(1)
    ws = _weights()
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(1))  # 128 KiB activations
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.5, copy_engine=engine))
    for step in range(6):
        if step % 2:
            expected = _forward(x, ws).detach()
            if order == "session_outside":
                with session, torch.inference_mode():
                    got = _forward(x, ws)
            else:
                with torch.inference_mode(), session:
                    got = _forward(x, ws)
            assert got.is_inference()
            assert torch.equal(expected, got)
        else:
            expected_train = _train(x, ws, None)
            got_train = _train(x, ws, session)
            assert all(torch.equal(a, b) for a, b in zip(expected_train, got_train, strict=True))
        report = session.last_report
        assert report is not None
        assert report.bytes_d2h > 0, f"step {step}: {report}"
        if engine == "sync":  # a page-in always copies (on the thread engine, one asked for before
            assert report.bytes_h2d > 0, f"step {step}: {report}"  # its eviction's copy ended does not)
        feasible = max(0.5 * MIB, report.min_feasible_budget_bytes or 0)
        assert report.peak_resident_bytes <= feasible * 1.05, f"step {step}: {report}"
