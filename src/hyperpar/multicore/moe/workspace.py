"""The execution resources of MoeExperts: communication buffers sized at capacity, and their lease.

One workspace serves every layer of a shared stack because layers run one at a time
and nothing a layer saves for backward points into it; the lease turns a violation of
that (two calls at once) into an error instead of silent corruption.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WorkspaceSpec:
    """What one layer needs from a workspace; a shared workspace fits the largest member."""

    hidden_size: int
    send_rows: int  # local_num_tokens * top_k
    capacity_rows: int  # rows one rank may receive
    ep_size: int

    @staticmethod
    def covering(specs: Iterable[WorkspaceSpec]) -> WorkspaceSpec:
        specs = list(specs)
        return WorkspaceSpec(
            hidden_size=max(s.hidden_size for s in specs),
            send_rows=max(s.send_rows for s in specs),
            capacity_rows=max(s.capacity_rows for s in specs),
            ep_size=max(s.ep_size for s in specs),
        )


class PendingBackward:
    """Marks a saved graph that will still use the workspace; released by backward or by
    the graph being freed, whichever comes first."""

    def __init__(self, workspace: MoeWorkspace) -> None:
        self._workspace: MoeWorkspace | None = workspace
        workspace._add_pending(1)

    def release(self) -> None:
        workspace, self._workspace = self._workspace, None
        if workspace is not None:
            workspace._add_pending(-1)

    def __del__(self) -> None:
        self.release()


class MoeWorkspace:
    """A receive buffer at capacity plus a send buffer, allocated once per binding."""

    def __init__(self, spec: WorkspaceSpec, device: torch.device, dtype: torch.dtype) -> None:
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self._lock = threading.RLock()  # reentrant: a freed graph may release from GC
        self._holder: str | None = None
        self._pending = 0
        self._closed = False
        shapes: dict[str, int] = {}
        if spec.ep_size > 1:
            # send: this rank's rows out, then their results back in; recv: rows in at
            # capacity, then the expert outputs out. One rank alone needs no buffers.
            shapes = {"send": spec.send_rows, "recv": spec.capacity_rows}
        self._rows = shapes
        # Allocated on first use, inside the layer's op: binding can happen inside an
        # OffloadSession, whose tracer must never take these buffers for activations.
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, rows: int, hidden: int) -> torch.Tensor:
        """A [rows, hidden] view at the start of buffer ``name`` (only valid under the lease)."""
        if self._closed:
            raise RuntimeError("MoeExperts workspace is closed")
        full = self._buffers.get(name)
        if full is None:
            full = self._buffers[name] = torch.empty(self._rows[name], self.spec.hidden_size,
                                                     device=self.device, dtype=self.dtype)
        return full.view(-1)[:rows * hidden].view(rows, hidden)

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold (allocated at the first call that communicates)."""
        return sum(rows * self.spec.hidden_size for rows in self._rows.values()) * self.dtype.itemsize

    @contextmanager
    def lease(self, what: str) -> Iterator[None]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"MoeExperts {what}: the workspace is closed")
            if self._holder is not None:
                raise RuntimeError(
                    f"MoeExperts {what} started while a {self._holder} holds the shared workspace: "
                    "layers that share execution resources must run one at a time")
            self._holder = what
        try:
            yield
        finally:
            with self._lock:
                self._holder = None

    def pending_backward(self) -> PendingBackward:
        return PendingBackward(self)

    def _add_pending(self, delta: int) -> None:
        with self._lock:
            self._pending += delta

    @property
    def pending_backwards(self) -> int:
        return self._pending

    def can_close(self) -> bool:
        return self._holder is None and self._pending == 0

    def close(self) -> None:
        if self._closed:
            return
        if not self.can_close():
            raise RuntimeError(
                f"MoeExperts workspace cannot close: call in progress={self._holder is not None}, "
                f"pending backward graphs={self._pending}; run or free them first")
        self._buffers.clear()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def lifecycle_signature(self) -> tuple[object, ...]:
        s = self.spec
        return ("MoeWorkspace", s.hidden_size, s.send_rows, s.capacity_rows, s.ep_size,
                str(self.dtype), self.device.type)
