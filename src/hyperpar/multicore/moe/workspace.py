"""The execution resources of MoeExperts: communication buffers, and their lease.

One workspace serves every layer of a shared stack because layers run one at a time
and nothing a layer saves for backward points into it; the lease turns a violation of
that (two calls at once) into an error instead of silent corruption.

The buffers are raw bytes grown to the largest call seen, not allocated at capacity: a
lossless receive buffer at capacity is ``ep_size`` times what balanced routing uses, and
those bytes are kept between steps. Bytes, so one workspace serves layers whose rows
travel in different dtypes (the ``gemm_dtype`` opt-in sends its rows in that dtype).
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
    """A send and a receive buffer per binding, each grown to the largest call seen (at most
    its capacity: ``capacity_rows`` of the widest dtype a member sends)."""

    def __init__(self, spec: WorkspaceSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self._lock = threading.RLock()  # reentrant: a freed graph may release from GC
        self._holder: str | None = None
        self._pending = 0
        self._closed = False
        # send: this rank's rows out, then their results back in; recv: rows in, then the
        # expert outputs out. One rank alone needs no buffers (route_rows never asks).
        self._capacity_rows = {"send": spec.send_rows, "recv": spec.capacity_rows}
        # Allocated on first use, inside the layer's op: binding can happen inside an
        # OffloadSession, whose tracer must never take these buffers for activations.
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, hidden] ``dtype`` view at the start of buffer ``name`` (only valid under the
        lease). A call that needs more bytes than the buffer holds replaces it (its contents are
        not kept): growth stops at the largest call, which the plan bounds by the capacity."""
        if self._closed:
            raise RuntimeError("MoeExperts workspace is closed")
        if rows > self._capacity_rows[name] or hidden > self.spec.hidden_size:
            raise AssertionError(f"MoeExperts workspace {name}: {rows}x{hidden} exceeds its capacity "
                                 f"{self._capacity_rows[name]}x{self.spec.hidden_size}")  # pragma: no cover
        need = rows * hidden * dtype.itemsize
        full = self._buffers.get(name)
        if full is None or full.numel() < need:
            self._buffers.pop(name, None)  # freed before the larger one is allocated
            full = self._buffers[name] = torch.empty(need, device=self.device, dtype=torch.uint8)
        return full[:need].view(dtype).view(rows, hidden)

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold now (none before the first call that communicates)."""
        return sum(b.numel() for b in self._buffers.values())

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
        return ("MoeWorkspace", s.hidden_size, s.send_rows, s.capacity_rows, s.ep_size, self.device.type)
