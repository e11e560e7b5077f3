"""The copy contract between device and host: start a copy, get an event, wait on it.

Only the synchronous engine exists now (each copy is complete when the call returns);
an asynchronous engine (copy streams, or a worker thread on CPU) can replace it without
touching the residency manager, which always waits on the event before reading.
"""

from __future__ import annotations

from typing import Protocol

import torch


class CopyEngine(Protocol):
    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Event | None: ...

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Event | None: ...

    def wait(self, event: torch.Event | None) -> None: ...


class SyncCopyEngine:
    """Copies on the caller's stream; the returned event is None (already complete)."""

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Event | None:
        dst.copy_(src)
        return None

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Event | None:
        dst.copy_(src)
        return None

    def wait(self, event: torch.Event | None) -> None:
        if event is not None:
            event.synchronize()
