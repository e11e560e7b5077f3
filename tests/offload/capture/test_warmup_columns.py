"""Warmup's columns and fused op path record exactly the trace the generic online path
records as objects (ops, accesses, guides, sizes, retained, pinned, deaths), and plan alike."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession, skip_offload
from hyperpar.offload.capture.mode.executor_base import ExecutorBase
from hyperpar.offload.capture.tracing.warmup import WarmupExecutor, recorded_trace
from hyperpar.offload.ir.packed import PackedTrace
from hyperpar.offload.ir.packed_view import LazyList


class ObjectWarmup(WarmupExecutor):
    """Warmup as it was: every op on ``online_op``, recorded as objects, packed afterwards."""

    record_op = ExecutorBase.record_op
    _op_duration = ExecutorBase._op_duration

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.online_op(func, args, kwargs)

    def build_packed(self, d2h_gbps: float, h2d_gbps: float) -> PackedTrace:
        return PackedTrace(recorded_trace(self, d2h_gbps, h2d_gbps, first_timed=0))


def _tiny(session: OffloadSession) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    ws = [torch.randn(4, generator=g).requires_grad_() for _ in range(30)]
    with session:
        for w in ws:
            x = torch.relu(x * w + 1.0) * 1.5
            x.add_(0.5)  # in place: the generic path
        x.sum().backward()
    return ws


def _gpt(session: OffloadSession) -> list[torch.Tensor]:
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(cfg)
    with session:
        torch.manual_seed(1)
        model.loss(*random_batch(cfg, 2, torch.Generator().manual_seed(0))).backward()
    return list(model.parameters())


def _region(session: OffloadSession) -> list[torch.Tensor]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    region = skip_offload(lambda t: torch.tanh(t) * 2)
    with session:
        y = region(lin(torch.randn(4, 16)))
        sum(t.sum() for t in torch.cat([y, y * 2]).split(3)).backward()
    return list(lin.parameters())


def _recorded(step: Any, config: OffloadConfig) -> tuple[dict[str, Any], list[torch.Tensor], Any]:
    torch.set_num_threads(1)
    session = OffloadSession(config)
    params = step(session)
    assert session.trace is not None and session._current is not None
    doc = session.trace.to_dict()
    for op in doc["ops"]:
        op["duration_ms"] = 0.0  # measured: differs run to run
    doc.pop("d2h_bandwidth_gbps"), doc.pop("h2d_bandwidth_gbps")
    return doc, [p.grad for p in params], session._current.packed.structure


@pytest.mark.parametrize("step", [_tiny, _gpt, _region], ids=["tiny", "gpt", "region"])
@pytest.mark.parametrize("config", [OffloadConfig(max_resident_fraction=0.4),
                                    OffloadConfig(max_resident_activation_mb=0.001)],
                         ids=["fraction", "tight"])
def test_columns_record_what_the_object_path_records(step: Any, config: OffloadConfig,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    doc, grads, structure = _recorded(step, config)
    monkeypatch.setattr("hyperpar.offload.api.session.WarmupExecutor", ObjectWarmup)
    old_doc, old_grads, old_structure = _recorded(step, config)
    assert doc["ops"] and doc["guides"]
    assert doc == old_doc
    assert structure == old_structure
    assert all(torch.equal(a, b) for a, b in zip(grads, old_grads, strict=True))


def test_lazy_list_makes_single_items_until_asked_for_all() -> None:
    made: list[int] = []

    def one(i: int) -> int:
        made.append(i)
        return i * 10

    lazy = LazyList(3, one, lambda: [0, 10, 20])
    assert len(lazy) == 3 and lazy[1] == 10 and lazy[-1] == 20 and made == [1, 2]
    with pytest.raises(IndexError):
        lazy[3]
    assert list(lazy) == [0, 10, 20] and lazy[1:] == [10, 20] and lazy == [0, 10, 20]
    assert made == [1, 2]  # the whole list came from the builder
