"""Each copy rule is caught: by the chaos engine on a user that breaks it, and by the fake
streams on a ``StreamCopyEngine`` with one of its waits (or ``record_stream``) taken out.
Each mutant case fails if the check that catches it is removed; the correct uses pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyperpar.offload.runtime.chaos_copy_engine import ChaosCopyEngine
from hyperpar.offload.runtime.copy_rules import CopyRuleViolation
from hyperpar.offload.runtime.stream_copy_engine import StreamCopyEngine
from tests.offload.runtime.fake_streams import FakeStreams

N = 1024


def _bytes(seed: int) -> torch.Tensor:
    return torch.randint(0, 255, (N,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _late() -> ChaosCopyEngine:
    return ChaosCopyEngine(0, timing="never")


# --- the chaos engine: a user that breaks a rule ----------------------------------------
def test_a_correct_round_trip_passes_and_moves_the_bytes() -> None:
    e = _late()
    dev, host = _bytes(1), torch.empty(N, dtype=torch.uint8)
    want = dev.clone()
    d2h = e.copy_d2h(host, dev)
    back = torch.empty(N, dtype=torch.uint8)
    h2d = e.copy_h2d(back, host, after=d2h)  # ordered after the copy that fills the slab
    e.wait(h2d)
    assert torch.equal(back, want) and e.violations == []


def test_waiting_for_an_event_the_engine_did_not_issue_is_caught() -> None:
    with pytest.raises(CopyRuleViolation, match="not an event of a copy this engine issued"):
        _late().wait(object())


def test_reading_a_slab_before_its_copy_in_is_done_is_caught() -> None:
    e = _late()
    host = torch.empty(N, dtype=torch.uint8)
    e.copy_d2h(host, _bytes(1))
    with pytest.raises(CopyRuleViolation, match="reads the destination"):
        e.copy_h2d(torch.empty(N, dtype=torch.uint8), host)  # no 'after'


def test_overwriting_a_source_a_copy_still_reads_is_caught() -> None:
    e = _late()
    host = _bytes(1)
    e.copy_h2d(torch.empty(N, dtype=torch.uint8), host)
    with pytest.raises(CopyRuleViolation, match="overwrites the source"):
        e.copy_d2h(host, _bytes(2))  # the slab reused before its H2D is done


def test_changing_a_source_before_its_copy_is_done_is_caught() -> None:
    e = _late()
    dev = _bytes(1)
    event = e.copy_d2h(torch.empty(N, dtype=torch.uint8), dev)
    dev.add_(1)  # an op writes the storage before waiting for its copy out
    with pytest.raises(CopyRuleViolation, match=r"source .* changed"):
        e.wait(event)


def test_freeing_a_source_before_its_copy_is_done_is_caught() -> None:
    e = _late()
    storage = torch.UntypedStorage(N)
    src = torch.empty(0, dtype=torch.uint8).set_(storage)
    event = e.copy_d2h(torch.empty(N, dtype=torch.uint8), src)
    storage.resize_(0)
    with pytest.raises(CopyRuleViolation, match=r"source .* freed"):
        e.wait(event)


def test_writing_a_destination_before_its_event_is_caught() -> None:
    e = _late()
    dev = torch.empty(N, dtype=torch.uint8)
    event = e.copy_h2d(dev, _bytes(1))
    dev.zero_()  # an op writes the storage before waiting for the copy in
    with pytest.raises(CopyRuleViolation, match="written before its event"):
        e.wait(event)


def test_reading_a_destination_before_its_event_sees_nans() -> None:
    e = _late()
    dev = torch.empty(N // 4, dtype=torch.float32)
    event = e.copy_h2d(dev.view(torch.uint8), torch.zeros(N, dtype=torch.uint8))
    assert torch.isnan(dev).all()  # what a missing wait would compute with
    e.wait(event)
    assert torch.equal(dev, torch.zeros_like(dev))


def test_one_seed_is_one_interleaving() -> None:
    def order(seed: int) -> list[tuple[str, int]]:
        e = ChaosCopyEngine(seed)
        hosts = [torch.empty(N, dtype=torch.uint8) for _ in range(12)]
        for i, h in enumerate(hosts):
            e.copy_d2h(h, _bytes(i), label=i)
            e.copy_h2d(torch.empty(N, dtype=torch.uint8), _bytes(i + 50), label=100 + i)
            e.poll()
        e.synchronize()
        return [(s.lane, s.label) for s in sorted(e.spans(), key=lambda s: (s.end_ms, s.start_ms))]

    assert order(3) == order(3)
    assert len({tuple(order(s)) for s in range(4)}) > 1


# --- StreamCopyEngine over fake streams, one step of its logic taken out ----------------
class _NoComputeWait(StreamCopyEngine):
    """Enqueues copies without waiting for the compute stream."""

    def _copy(self, lane: str, dst: torch.Tensor, src: torch.Tensor, after: Any, label: int,
              device_side: torch.Tensor) -> Any:
        stream = self._streams[lane]
        stream.wait_stream = lambda other: None  # type: ignore[method-assign]
        try:
            return super()._copy(lane, dst, src, after, label, device_side)
        finally:
            del stream.wait_stream


class _NoAfter(StreamCopyEngine):
    """Ignores ``after`` (the slab's previous copy)."""

    def _copy(self, lane: str, dst: torch.Tensor, src: torch.Tensor, after: Any, label: int,
              device_side: torch.Tensor) -> Any:
        return super()._copy(lane, dst, src, None, label, device_side)


class _NoRecordStream(StreamCopyEngine):
    """Frees memory a copy uses without telling the allocator (no ``record_stream``)."""

    def __init__(self, device: torch.device, backend: Any) -> None:
        super().__init__(device, backend)
        backend.record_stream = lambda tensor, stream: None


class _NoComputeSideWait(StreamCopyEngine):
    """``wait`` returns without making the compute stream wait."""

    def wait(self, event: Any) -> None:
        return None


def _engine(cls: type[StreamCopyEngine]) -> tuple[StreamCopyEngine, FakeStreams]:
    backend = FakeStreams(0, timing="never")  # every copy completes only when waited on
    return cls(torch.device("cpu"), backend), backend


@pytest.mark.parametrize("cls", [StreamCopyEngine, _NoComputeWait])
def test_a_copy_waits_for_the_compute_stream(cls: type[StreamCopyEngine]) -> None:
    engine, _ = _engine(cls)
    if cls is StreamCopyEngine:
        engine.wait(engine.copy_d2h(torch.empty(N, dtype=torch.uint8), _bytes(1)))
        return
    with pytest.raises(CopyRuleViolation, match="without waiting for the compute stream"):
        engine.copy_d2h(torch.empty(N, dtype=torch.uint8), _bytes(1))


@pytest.mark.parametrize("cls", [StreamCopyEngine, _NoAfter])
def test_a_reused_slab_waits_for_its_previous_copy(cls: type[StreamCopyEngine]) -> None:
    engine, backend = _engine(cls)
    slab = torch.empty(N, dtype=torch.uint8)
    d2h = engine.copy_d2h(slab, _bytes(1))
    # the H2D lane reads the slab: it must come after the D2H that fills it
    if cls is StreamCopyEngine:
        engine.wait(engine.copy_h2d(torch.empty(N, dtype=torch.uint8), slab, after=d2h))
        assert backend.violations == []
        return
    with pytest.raises(CopyRuleViolation, match="reads the destination"):
        engine.copy_h2d(torch.empty(N, dtype=torch.uint8), slab, after=d2h)


@pytest.mark.parametrize("cls", [StreamCopyEngine, _NoRecordStream])
def test_memory_freed_under_a_copy_is_held_for_it(cls: type[StreamCopyEngine]) -> None:
    engine, _ = _engine(cls)
    storage = torch.UntypedStorage(N)
    src = torch.empty(0, dtype=torch.uint8).set_(storage)
    src.copy_(_bytes(1))
    want = src.clone()
    host = torch.empty(N, dtype=torch.uint8)
    event = engine.copy_d2h(host, src)
    storage.resize_(0)  # the storage dies (or is freed) while its copy out runs
    if cls is StreamCopyEngine:
        engine.finish(event)
        assert torch.equal(host, want)
        return
    with pytest.raises(CopyRuleViolation, match=r"source .* freed"):
        engine.finish(event)


@pytest.mark.parametrize("cls", [StreamCopyEngine, _NoComputeSideWait])
def test_the_compute_side_waits_before_reading_a_copy_in(cls: type[StreamCopyEngine]) -> None:
    engine, _ = _engine(cls)
    dev = torch.empty(N // 4, dtype=torch.float32)
    engine.wait(engine.copy_h2d(dev.view(torch.uint8), torch.zeros(N, dtype=torch.uint8)))
    read = dev.sum()  # the next op on the compute stream
    assert torch.isnan(read) == (cls is _NoComputeSideWait)


def test_a_release_waits_for_its_copy_out_before_freeing() -> None:
    engine, _ = _engine(StreamCopyEngine)
    event = engine.copy_d2h(torch.empty(N, dtype=torch.uint8), _bytes(1))
    assert not engine.may_free_now(_bytes(1), event)  # counted on the device until it is done
    engine.finish(event)
    assert engine.may_free_now(_bytes(1), event)
