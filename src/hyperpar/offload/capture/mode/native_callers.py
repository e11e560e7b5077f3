"""Native calls that read tensors they made through raw pointers across later ops.

Evicting a storage frees its memory; a caller that holds a raw pointer into it (a C++
``TensorAccessor``) across the next op would then read freed memory. Torch code that does
this on the training path is run untouched by the session while a step runs (the ops it
dispatches are neither tracked nor able to evict anything):

- DDP's ``Reducer._rebuild_buckets`` (the second iteration, before the forward): it fills
  an index tensor through an accessor, broadcasts it, and reads it back through the same
  accessor after the ops that allocate the next tensors; at a small budget warmup evicted
  it in between, and the ranks disagreed on the bucket sizes.

Wrapped while a session lives (``dispatch_mode.hold_step_hooks``), like
``OptimizedModule.__call__`` (see ``compiled``); outside a step the wrapper only calls it.
"""

from __future__ import annotations

from typing import Any

from hyperpar.offload.capture.mode import dispatch_mode
from hyperpar.offload.capture.mode.executor_base import internal

_originals: dict[tuple[Any, str], Any] = {}


def _targets() -> list[tuple[Any, str]]:
    try:
        from torch._C._distributed_c10d import Reducer
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    return [(Reducer, "_rebuild_buckets")]


def _untouched(original: Any) -> Any:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        mode = dispatch_mode.current_offload_mode()
        ex = mode.executor if mode is not None else None
        if ex is None or ex.closed:
            return original(self, *args, **kwargs)
        with internal(ex):
            return original(self, *args, **kwargs)

    return call


def _wrap() -> None:
    for owner, name in _targets():
        original = owner.__dict__[name]
        _originals[(owner, name)] = original
        setattr(owner, name, _untouched(original))


def _unwrap() -> None:
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()


dispatch_mode.STEP_HOOKS.append((_wrap, _unwrap))
