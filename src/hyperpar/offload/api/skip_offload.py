"""skip_offload: run a function as one opaque op of the active session."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hyperpar.offload.capture import current_offload_mode, is_compiled, run_compiled, run_opaque

F = TypeVar("F", bound=Callable[..., Any])


def skip_offload(fn: F) -> F:
    """Decorator or wrapper; outside a session (or inside another region) it just calls fn.

    A torch.compile'd ``fn`` (``torch.compile(f)``, a module compiled with ``module.compile()``)
    becomes a compiled region: it runs compiled, with the session's dispatch mode suspended
    (see ``capture/mode/compiled.py``).
    """
    if not callable(fn):
        raise TypeError(f"skip_offload needs a callable, got {fn!r} of type {type(fn).__name__}")
    name = "skip_offload(" + str(getattr(fn, "__qualname__", type(fn).__qualname__)) + ")"

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mode = current_offload_mode()
        executor = mode.executor if mode is not None else None
        if executor is None or executor.closed or executor.passthrough:
            return fn(*args, **kwargs)
        if is_compiled(fn):  # checked per call: module.compile() may come after wrapping
            module = fn if isinstance(fn, torch.nn.Module) else None
            return run_compiled(executor, mode, name, fn, args, kwargs, module)  # type: ignore[arg-type]
        if executor.opaque_depth:
            return fn(*args, **kwargs)
        return run_opaque(executor, name, fn, args, kwargs)

    functools.update_wrapper(wrapper, fn, updated=())
    return wrapper  # type: ignore[return-value]
