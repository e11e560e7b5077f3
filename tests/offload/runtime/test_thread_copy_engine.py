"""The CPU copy engine: copies run beside the caller, in issue order per lane, with events."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from hyperpar.offload.runtime import ThreadCopyEngine, make_copy_engine
from hyperpar.offload.runtime.copy_engine import D2H_LANE, H2D_LANE, SyncCopyEngine


def test_copies_complete_asynchronously_and_in_issue_order() -> None:
    engine = ThreadCopyEngine(delay_s=0.02)
    engine.begin_step()
    srcs = [torch.full((1000,), float(i)) for i in range(3)]
    dsts = [torch.zeros(1000) for _ in range(3)]
    events = [engine.copy_d2h(d, s, label=i) for i, (d, s) in enumerate(zip(dsts, srcs, strict=True))]
    assert not engine.is_done(events[0])  # the caller did not wait for the copy
    engine.wait(events[1])
    assert engine.is_done(events[0]) and engine.is_done(events[1])  # one lane: issue order
    engine.end_step()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    spans = engine.spans()
    assert [s.label for s in spans] == [0, 1, 2] and {s.lane for s in spans} == {D2H_LANE}
    assert all(b.start_ms >= a.end_ms - 1e-6 for a, b in itertools.pairwise(spans))
    assert spans[0].nbytes == 4000 and engine.exposed_wait_ms() >= 20.0
    engine.close()


def test_lanes_run_side_by_side_and_after_orders_across_lanes() -> None:
    engine = ThreadCopyEngine(delay_s=0.05)
    engine.begin_step()
    host = torch.zeros(10)
    dev_src = torch.arange(10.0)
    dev_dst = torch.zeros(10)
    d2h = engine.copy_d2h(host, dev_src)
    h2d = engine.copy_h2d(dev_dst, host, after=d2h)  # must read the host copy only once written
    engine.wait(h2d)
    assert torch.equal(dev_dst, dev_src)
    engine.end_step()
    lanes = {s.lane: s for s in engine.spans()}
    assert lanes[H2D_LANE].start_ms >= lanes[D2H_LANE].end_ms - 1e-6
    engine.close()


def test_a_failing_copy_raises_at_the_wait() -> None:
    engine = ThreadCopyEngine(inline_bytes=0)
    event = engine.copy_h2d(torch.zeros(3), torch.zeros(4))  # size mismatch fails in the worker
    with pytest.raises(RuntimeError, match="asynchronous copy failed"):
        engine.wait(event)
    engine.close()


def test_tensors_are_released_on_the_calling_thread() -> None:
    """The worker never drops the last reference (weakref callbacks must run on the compute thread)."""
    engine = ThreadCopyEngine(inline_bytes=0)
    src = torch.ones(100)
    deaths: list[str] = []
    storage = src.untyped_storage()
    import weakref

    ref = weakref.ref(storage, lambda _r: deaths.append(threading.current_thread().name))
    event = engine.copy_d2h(torch.zeros(100), src)
    del src, storage
    engine.wait(event)
    time.sleep(0.01)
    assert ref() is not None and deaths == []  # the finished copy still holds it ...
    engine.poll()
    assert deaths == [threading.current_thread().name]  # ... until the caller polls
    engine.close()


def test_factory_picks_threads_on_cpu_and_rejects_bad_kinds() -> None:
    assert make_copy_engine(torch.device("cpu")).name == "thread"
    assert isinstance(make_copy_engine(torch.device("cpu"), "sync"), SyncCopyEngine)
    with pytest.raises(ValueError, match="'stream' needs an accelerator"):
        make_copy_engine(torch.device("cpu"), "stream")
    with pytest.raises(ValueError, match="'warp'"):
        make_copy_engine(torch.device("cpu"), "warp")


def test_small_copies_run_inline_and_still_show_on_the_timeline() -> None:
    engine = ThreadCopyEngine()
    engine.begin_step()
    small_src, small_dst = torch.arange(16.0), torch.zeros(16)
    assert engine.copy_d2h(small_dst, small_src, label=5) is None  # done on return
    assert torch.equal(small_dst, small_src)
    big_src = torch.ones(engine.inline_bytes // 4 + 1)
    event = engine.copy_h2d(torch.zeros_like(big_src), big_src, label=6)
    assert event is not None
    engine.end_step()
    assert [(s.lane, s.label) for s in engine.spans()] == [(D2H_LANE, 5), (H2D_LANE, 6)]
    slow = ThreadCopyEngine(delay_s=0.01)
    assert slow.inline_bytes == 0  # the slow test engine hands off everything ...
    assert slow.name != engine.name  # ... and never shares the fast engine's cached bandwidth
    with pytest.raises(ValueError, match="delay_s"):
        ThreadCopyEngine(delay_s=-1.0)
    engine.close()


@pytest.mark.parametrize(("env", "kind"), [("auto", ThreadCopyEngine), ("", ThreadCopyEngine),
                                           ("sync", SyncCopyEngine)])
def test_the_engine_variable_may_name_auto_too(monkeypatch: pytest.MonkeyPatch, env: str, kind: type) -> None:
    """``HYPERPAR_COPY_ENGINE=auto`` means what ``auto`` means (it was refused as unknown)."""
    monkeypatch.setenv("HYPERPAR_COPY_ENGINE", env)
    engine = make_copy_engine(torch.device("cpu"))
    try:
        assert isinstance(engine, kind)
    finally:
        engine.close()
