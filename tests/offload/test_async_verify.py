"""``OffloadConfig(verify=True)``: a host copy changed on purpose is caught, naming op and storage."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.runtime import HostCopyCorruptedError, ThreadCopyEngine
from tests.offload.equality_harness import Case, run_equality


class CorruptingEngine(ThreadCopyEngine):
    """Flips one byte of the host copy of every D2H once ``armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, label: int = -1) -> Any:
        event = super().copy_d2h(dst, src, after, label)
        if self.armed:
            if event is not None:
                event.synchronize()
            dst[:1].bitwise_xor_(0x5A)
        return event


def _gpt() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = GPTConfig.tiny()
    return GPT(cfg), random_batch(cfg, 2, torch.Generator().manual_seed(0))


def test_corrupted_host_copy_raises_naming_op_and_storage() -> None:
    model, batch = _gpt()
    engine = CorruptingEngine()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0, device="cpu", verify=True,
                                           copy_engine=engine))
    for _ in range(2):  # warmup and a clean replay
        model.zero_grad(set_to_none=True)
        with session:
            model.loss(*batch).backward()
    engine.armed = True
    model.zero_grad(set_to_none=True)
    named = r"storage \d+ .*produced by op \d+.* at op \d+ \(aten\."
    with pytest.raises(HostCopyCorruptedError, match=named):
        with session:
            model.loss(*batch).backward()
    engine.armed = False
    assert session.tracked_storages() == 0
    model.zero_grad(set_to_none=True)
    with session:  # still usable afterwards
        model.loss(*batch).backward()
    assert session.last_report is not None and session.last_report.phase == "replay"


def test_without_corruption_verify_changes_nothing() -> None:
    cfg = GPTConfig.tiny()
    batches = [random_batch(cfg, 2, torch.Generator().manual_seed(i)) for i in range(3)]
    case = Case("gpt-verify", lambda: GPT(cfg), lambda step: batches[step],
                loss=lambda model, args: model.loss(*args))
    reports = run_equality(case, fractions=(0.0,), replays=2, verify=True)
    assert reports[0.0][-1].bytes_h2d > 0
