"""Copy engines that wrap the session's real one and fail chosen copies: ``FaultyEngine`` one
copy by its position, ``FailingStorages`` every H2D into storages of chosen sizes.

``mode="submit"``: the call that starts the copy raises ``exc`` (the engine refused it).
``mode="inflight"``: the copy is started with a destination of the wrong size, so it fails
where copies run (a worker thread for the CPU engine) and the error surfaces when someone
waits on its event; nothing may have been read from a copy that never happened.
"""

from __future__ import annotations

from typing import Any

import torch


class FaultyEngine:
    def __init__(self, inner: Any, direction: str, fail_at: int, mode: str, exc: BaseException) -> None:
        self.inner = inner
        self.direction, self.fail_at, self.mode, self.exc = direction, fail_at, mode, exc
        self.name = f"faulty({getattr(inner, 'name', type(inner).__name__)})"
        self.asynchronous = bool(getattr(inner, "asynchronous", False))
        self.calls = 0
        self.fired = False

    def __getattr__(self, name: str) -> Any:  # everything but the two copies goes to the real engine
        return getattr(self.inner, name)

    def _hit(self, direction: str) -> bool:
        if direction != self.direction:
            return False
        self.calls += 1
        if self.calls - 1 != self.fail_at:
            return False
        self.fired = True
        if self.mode == "submit":
            raise self.exc
        return True

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, label: int = -1) -> Any:
        if self._hit("d2h"):
            dst = dst[:0]
        return self.inner.copy_d2h(dst, src, after, label)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, label: int = -1) -> Any:
        if self._hit("h2d"):
            dst = dst[:0]
        return self.inner.copy_h2d(dst, src, after, label)


class FailingStorages:
    """Wraps a real engine; every H2D into a storage of one of ``nbytes`` sizes raises at
    submit (a storage whose bytes can never come back), every other copy is real."""

    def __init__(self, inner: Any, nbytes: set[int]) -> None:
        self.inner, self.nbytes = inner, set(nbytes)
        self.name = f"failing({getattr(inner, 'name', type(inner).__name__)})"
        self.asynchronous = bool(getattr(inner, "asynchronous", False))
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, label: int = -1) -> Any:
        if dst.numel() * dst.element_size() in self.nbytes:
            self.failed += 1
            raise RuntimeError(f"injected H2D failure into {dst.numel() * dst.element_size()} bytes")
        return self.inner.copy_h2d(dst, src, after, label)
