"""The fast path's saved-tensor guards running on this thread, and stepping them aside.

Compiled regions (this layer) must lift the running step's guard, which lives a layer up
(``capture.fast.saved_tensor_guard``): the stack sits here so the mode layer needs nothing
from the fast path. A guard is anything with ``pack``, ``unpack`` and a ``lifted`` flag.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch


class _Guards(threading.local):
    def __init__(self) -> None:
        self.guards: list[Any] = []


_local = _Guards()


def running_guards() -> list[Any]:
    """This thread's guards, innermost last (the guard pushes and pops itself)."""
    return _local.guards


@contextlib.contextmanager
def guard_lifted() -> Iterator[None]:
    """The running step's guard steps aside for a block that must not run under our hooks
    (torch.func's transforms refuse any; compiled code has its own handling of them): the
    step is marked as not fully seen, so its structure does not take the fast path."""
    guard = _local.guards[-1] if _local.guards else None
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    lift = guard is not None and top is not None and top[0] == guard.pack
    if lift:
        guard.lifted = True
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        if lift:
            torch._C._autograd._push_saved_tensors_default_hooks(guard.pack, guard.unpack)
