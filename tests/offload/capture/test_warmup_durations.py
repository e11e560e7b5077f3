"""Warmup's per-op times: on the host clock taken as each op returns, with device events read
from the marks at the end of the step (a stand-in timer plays the events on CPU)."""

from __future__ import annotations

import time

import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.runtime import OpTimer


class EventLikeTimer(OpTimer):
    """Marks as a device-event timer makes them (indices, read once at the end), on the host
    clock with each op made to last 1 ms between its marks."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.use_events, self.host_marks = True, None
        self.stamps: list[float] = []

    def begin_step(self) -> None:
        self.stamps = []
        self.mark()

    def end_step(self) -> None:
        self.stamps = []

    def mark(self) -> int:
        self.stamps.append(len(self.stamps) * 1.0)  # 1 ms after the mark before it
        return len(self.stamps) - 1

    def times_ms(self) -> list[float]:
        return list(self.stamps)


def _step(session: OffloadSession, sleep_op: int = -1) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    ws = [torch.randn(4, generator=g).requires_grad_() for _ in range(6)]
    with session:
        for i, w in enumerate(ws):
            if i == sleep_op:
                time.sleep(0.1)  # host time between two ops: the gap before the next one
            x = torch.relu(x * w + 1.0) * 1.5
            x.add_(0.5)  # in place: the general path
        x.sum().backward()


def test_host_clock_times_every_op_and_adds_the_gap_before_it() -> None:
    torch.set_num_threads(1)
    session = OffloadSession(OffloadConfig(max_resident_fraction=0.5))
    _step(session, sleep_op=3)
    assert session.trace is not None
    durations = [op.duration_ms for op in session.trace.ops]
    names = [op.name for op in session.trace.ops]
    assert len(durations) == len(names) > 20 and all(d >= 0.0 for d in durations)
    after_sleep = [i for i, n in enumerate(names) if n == "aten.add_.Tensor"][2] + 1  # a layer ends with add_
    assert names[after_sleep] == "aten.mul.Tensor"
    assert durations[after_sleep] >= 100.0  # the 100 ms of host time before it
    assert durations[after_sleep - 1] < 100.0  # not the op before it


def test_device_events_give_every_op_the_time_between_its_marks() -> None:
    torch.set_num_threads(1)
    session = OffloadSession(OffloadConfig(max_resident_fraction=0.5))
    session._timer = EventLikeTimer()
    _step(session, sleep_op=3)
    assert session.trace is not None
    durations = [op.duration_ms for op in session.trace.ops]
    assert len(durations) > 20 and all(d == 1.0 for d in durations)  # marks only: no host gap
