"""The execution resources of MoeExperts: communication buffers, and their lease.

One workspace serves every layer of a shared stack because layers run one at a time
and nothing a layer saves for backward points into it; the lease turns a violation of
that (two calls at once) into an error instead of silent corruption.

The buffers are one arena of raw bytes grown to the largest call seen, not allocated at
capacity: a lossless receive buffer at capacity is ``ep_size`` times what balanced routing
uses, and those bytes are kept between steps. Bytes, so one workspace serves layers whose
rows travel in different dtypes (the ``gemm_dtype`` opt-in sends its rows in that dtype).
One arena rather than a send and a receive buffer, so that once a call's exchanges have
completed its backward can park one large temporary in all of it (``scratch``) instead of
allocating it beside the kept bytes at the step's peak.
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
    """One arena holding a call's send and receive buffers, grown to the largest call seen (the
    exchange part at most its capacity: ``capacity_rows`` received and ``send_rows`` sent rows of
    the widest dtype a member sends)."""

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
        # OffloadSession, whose tracer must never take these bytes for activations.
        self._arena: torch.Tensor | None = None

    def _bytes(self, need: int) -> torch.Tensor:
        """The arena, replaced by a larger one (contents not kept) when it holds fewer than ``need``."""
        if self._closed:
            raise RuntimeError("MoeExperts workspace is closed")
        if self._arena is None or self._arena.numel() < need:
            self._arena = None  # freed before the larger one is allocated
            self._arena = torch.empty(need, device=self.device, dtype=torch.uint8)
        return self._arena

    def exchange_buffers(self, send_rows: int, recv_rows: int, hidden: int, dtype: torch.dtype,
                         send_total: int | None = None,
                         recv_total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[send_total, hidden] and [recv_total, hidden] ``dtype`` views of disjoint parts of the
        arena (only valid under the lease) for ``send_rows`` and ``recv_rows`` rows and the rows
        their values are packed into (the totals; by default none). A call that needs more bytes
        than the arena holds replaces it: growth stops at the largest call, which the plan
        bounds by the capacity (plus a few value rows per thousand)."""
        for name, rows in (("send", send_rows), ("recv", recv_rows)):
            if rows > self._capacity_rows[name] or hidden > self.spec.hidden_size:  # pragma: no cover
                raise AssertionError(f"MoeExperts workspace {name}: {rows}x{hidden} exceeds its capacity "
                                     f"{self._capacity_rows[name]}x{self.spec.hidden_size}")
        send_total = send_rows if send_total is None else send_total
        recv_total = recv_rows if recv_total is None else recv_total
        send_bytes = _aligned(send_total * hidden * dtype.itemsize)
        recv_bytes = recv_total * hidden * dtype.itemsize
        arena = self._bytes(send_bytes + recv_bytes)
        return (_view(arena, 0, send_total, hidden, dtype),
                _view(arena, send_bytes, recv_total, hidden, dtype))

    def scratch(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised [rows, width] ``dtype`` view of the arena for a temporary of the call
        holding the lease, once its exchanges have completed (it overwrites their buffers), or
        None: no arena yet (nothing communicates), or more bytes than the exchange capacity. The
        arena grows to hold it, so a call's temporary can cost kept bytes only up to that bound."""
        need = rows * width * dtype.itemsize
        limit = (self.spec.send_rows + self.spec.capacity_rows) * self.spec.hidden_size * dtype.itemsize
        if self._arena is None or need > limit:
            return None
        return _view(self._bytes(need), 0, rows, width, dtype)

    @property
    def nbytes(self) -> int:
        """Bytes the arena holds now (none before the first call that communicates)."""
        return 0 if self._arena is None else self._arena.numel()

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
        self._arena = None
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def lifecycle_signature(self) -> tuple[object, ...]:
        s = self.spec
        return ("MoeWorkspace", s.hidden_size, s.send_rows, s.capacity_rows, s.ep_size, self.device.type)


_ALIGN = 64  # every view starts at a cache-line boundary (``torch._grouped_mm`` needs 16 bytes)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _view(arena: torch.Tensor, begin: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return arena[begin:begin + rows * width * dtype.itemsize].view(dtype).view(rows, width)
