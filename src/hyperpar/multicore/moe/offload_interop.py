"""Inside an ``OffloadSession`` a MoeExperts call runs as one opaque op (``skip_offload``).

Its collectives complete asynchronously and it writes into long-lived workspace buffers
that are not activations; tracing or evicting its inner tensors would free memory that a
collective is still writing (measured: a segfault on 2 gloo ranks at budget 0). As one
opaque op its inputs and output are still planned and moved like any other activation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hyperpar.offload import OffloadSession, skip_offload

T = TypeVar("T")


def call_opaque_to_offload(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, as one opaque op when an offload session is active."""
    if OffloadSession.get_active() is None:
        return fn(*args, **kwargs)
    return skip_offload(fn)(*args, **kwargs)
