"""Recompute, executed: the module calls a plan rebuilds in backward run under torch's own
non-reentrant checkpoint while a step runs.

The plan names module instances (the calls warmup saw); for the step their ``forward`` is
replaced on the instance by one that calls the original through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, and put back when the step
ends, however it ends. Nothing the module saves for backward is kept: its inputs are, and in
backward the call runs again with the random-number state and autocast state it saw
(``preserve_rng_state``), so a rebuilt tensor is bitwise the one forward made, and torch
checks that every tensor it rebuilds has the shape and dtype it had. A recipe input changed
in place since forward is caught by autograd's version counter on the saved input, as for
any saved tensor. Why torch's checkpoint and not our own recipes: it is the mechanism users
already trust (HF ``gradient_checkpointing``, torchtitan), it replays RNG and autocast, and a
recomputing call shows our dispatch mode its ops like any others, so the plan that offloads
the rest is made on a trace of the step as it really runs.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)


class RecomputeRegions:
    """Module instances whose calls a step rebuilds in backward instead of keeping what they
    save. Held weakly: a module gone since the plan is simply not wrapped."""

    def __init__(self, modules: list[torch.nn.Module], saved_bytes: int = 0) -> None:
        self._modules = [weakref.ref(m) for m in modules]
        self.saved_bytes = saved_bytes  # what the plan expects them not to keep, per step
        self.names = [type(m).__name__ for m in modules]

    def __len__(self) -> int:
        return sum(1 for ref in self._modules if ref() is not None)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """For one step: each module's calls checkpointed; the original ``forward`` back after
        (an instance attribute set by the user before is restored as it was)."""
        patched: list[tuple[torch.nn.Module, Any]] = []
        try:
            for ref in self._modules:
                module = ref()
                if module is None or _is_wrapped(module.forward):
                    continue
                before = module.__dict__.get("forward", _ABSENT)
                module.forward = _checkpointed(module.forward)  # type: ignore[method-assign]
                patched.append((module, before))
            yield
        finally:
            for module, before in reversed(patched):
                if before is _ABSENT:
                    del module.forward
                else:
                    module.forward = before  # type: ignore[method-assign]


_ABSENT = object()


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved without grad: plain call
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    run.__hyperpar_recompute__ = True  # type: ignore[attr-defined]
    return run


def _is_wrapped(fn: Any) -> bool:
    return bool(getattr(fn, "__hyperpar_recompute__", False))
