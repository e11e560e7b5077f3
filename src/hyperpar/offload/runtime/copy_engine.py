"""The copy contract between device and host: start a copy, get an event, wait on it.

Three engines keep one contract, so the residency manager never asks which one it has:
``SyncCopyEngine`` (each copy complete when the call returns), ``StreamCopyEngine``
(accelerator copy streams, one per direction) and ``ThreadCopyEngine`` (on CPU, one worker
thread per direction), the last two asynchronous. A copy may name an event it must start
after (``after``): the host slab's previous copy, or the storage's copy the other way.
Choosing an engine by name is ``engine_factory``'s job, so this file imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

D2H_LANE, H2D_LANE = "D2H", "H2D"
DISK_WRITE_LANE, DISK_READ_LANE = "disk write", "disk read"  # the disk tier's I/O thread


@dataclass(slots=True)
class CopySpan:
    """One copy on a transfer lane, in ms from the start of the step (for the timeline)."""

    lane: str
    label: int  # the storage id, or -1
    nbytes: int
    start_ms: float
    end_ms: float


class CopyEngine(Protocol):
    name: str
    asynchronous: bool

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, label: int = -1) -> Any:
        """Start copying device bytes ``src`` to host ``dst``; returns an event (None: done)."""

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, label: int = -1) -> Any:
        """Start copying host bytes ``src`` to device ``dst``; returns an event (None: done)."""

    def is_done(self, event: Any) -> bool: ...

    def wait(self, event: Any) -> None:
        """The compute side waits for ``event`` (on a stream: without blocking the host)."""

    def finish(self, event: Any) -> None:
        """The host waits until the copy is done (its memory may then be freed and reused)."""

    def may_free_now(self, src: torch.Tensor, event: Any) -> bool:
        """Whether the device memory a D2H reads may be freed now (else: once ``is_done``)."""

    def poll(self) -> None:
        """Compute-side housekeeping between ops (cheap when there is nothing to do)."""

    def begin_step(self) -> None: ...

    def end_step(self) -> None:
        """Wait for every copy; the step's spans and waits become readable."""

    def synchronize(self) -> None: ...

    def exposed_wait_ms(self) -> float: ...

    def spans(self) -> list[CopySpan]: ...

    def close(self) -> None: ...


class SyncCopyEngine:
    """Copies on the caller's stream; every event is None (already complete)."""

    name = "sync"
    asynchronous = False

    def __init__(self) -> None:
        self._spans: list[CopySpan] = []

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, label: int = -1) -> Any:
        dst.copy_(src)
        return None

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, label: int = -1) -> Any:
        dst.copy_(src)
        return None

    def is_done(self, event: Any) -> bool:
        return True

    def wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def finish(self, event: Any) -> None:
        self.wait(event)

    def may_free_now(self, src: torch.Tensor, event: Any) -> bool:
        return True

    def poll(self) -> None:
        return None

    def begin_step(self) -> None:
        return None

    def end_step(self) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def exposed_wait_ms(self) -> float:
        return 0.0

    def spans(self) -> list[CopySpan]:
        return self._spans

    def close(self) -> None:
        return None
