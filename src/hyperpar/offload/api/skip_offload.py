"""skip_offload: run a function as one opaque op of the active session."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from hyperpar.offload.capture import current_offload_mode, run_opaque

F = TypeVar("F", bound=Callable[..., Any])


def skip_offload(fn: F) -> F:
    """Decorator or wrapper; outside a session (or inside another region) it just calls fn."""
    if not callable(fn):
        raise TypeError(f"skip_offload needs a callable, got {fn!r} of type {type(fn).__name__}")
    name = "skip_offload(" + str(getattr(fn, "__qualname__", type(fn).__qualname__)) + ")"

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mode = current_offload_mode()
        executor = mode.executor if mode is not None else None
        if executor is None or executor.closed or executor.opaque_depth or executor.passthrough:
            return fn(*args, **kwargs)
        return run_opaque(executor, name, fn, args, kwargs)

    functools.update_wrapper(wrapper, fn, updated=())
    return wrapper  # type: ignore[return-value]
