"""One storage a fast step's plan moves (``fast_moves.MovingStep``'s record of it)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from hyperpar.offload.runtime.residency_manager import byte_view

Tensor = torch.Tensor

_use_count = torch._C._storage_Use_Count


class MoveSlot:
    """One storage the plan moves: its device bytes (the original, then a paged-in copy, or
    None), its host copy, the copies' events, the source the copy out reads (weakly: the
    engine holds it while the copy may read), and the last tensor rebuilt from it."""

    __slots__ = ("d2h", "device", "h2d", "host", "nbytes", "original", "sid", "src", "view", "view_key")

    def __init__(self, storage: torch.UntypedStorage, sid: int = -1) -> None:
        self.sid = sid  # the plan's storage id (said in errors)
        self.device: torch.UntypedStorage | None = storage
        self.original = weakref.ref(storage)
        self.nbytes = storage.nbytes()
        self.host: Tensor | None = None
        self.d2h: Any = None
        self.h2d: Any = None
        self.src: weakref.ref | None = None
        self.view: Tensor | None = None
        self.view_key: tuple[Any, ...] | None = None

    # what the disk tier reads and sets of a host copy (``runtime.disk_tier``)
    @property
    def host_event(self) -> Any:
        return self.d2h

    @host_event.setter
    def host_event(self, event: Any) -> None:
        self.d2h = event

    @property
    def h2d_event(self) -> Any:
        return self.h2d

    def held_elsewhere(self) -> bool:
        """Whether a tensor (Python's, autograd's) still holds the user's storage: anything but
        its Python object, which this slot may keep, and a copy out still reading it."""
        original = self.original()
        if original is None:
            return False
        engine_holds = self.src is not None and self.src() is not None
        return _use_count(original._cdata) > 1 + engine_holds

    def live(self, bring_back: bool) -> torch.UntypedStorage | None:
        """The user's storage while it lives on the device (its bytes are the live ones). One
        the fallback's dispatch mode evicted has them with the mode: only where a ``.data``
        alias may have written it since the copy out is it brought back (``bring_back``: any
        op reading it under the mode does that; a ``set_`` onto it would resize it instead, to
        garbage bytes); else the slot's host copy is as good and the mode keeps its budget."""
        original = self.original()
        if original is not None and original.nbytes() != self.nbytes:
            if not bring_back:
                return None
            torch.ops.aten.alias.default(byte_view(original))
        return original
