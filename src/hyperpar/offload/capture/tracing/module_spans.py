"""Which ops each module call of a traced forward ran: the regions a plan may recompute.

Recompute runs at module calls (``runtime.recompute_regions``), so the planner must know,
per call, the ops between its start and its end. Global module hooks (torch's
``register_module_forward_pre_hook`` / ``register_module_forward_hook``) give both ends;
the executor's op counter gives the ops. Only forward calls on the step's thread count (a
checkpoint's recomputation in backward calls modules again). Hooks live only while a
warmup that records spans runs.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.modules import module as nn_module


@dataclass(frozen=True, slots=True)
class ModuleSpan:
    """One forward call: ops ``first`` to ``end - 1`` ran inside it (``end == first``: none)."""

    module: weakref.ref  # to the torch.nn.Module called
    first: int
    end: int
    depth: int  # calls it ran inside


class ModuleSpans:
    """Records the spans of a step's module calls while entered."""

    def __init__(self, clock: Any) -> None:
        self._clock = clock  # () -> ops run so far
        self._thread = threading.get_ident()
        self._open: list[tuple[torch.nn.Module, int]] = []
        self.spans: list[ModuleSpan] = []
        self._handles: list[Any] = []

    def __enter__(self) -> ModuleSpans:
        self._handles = [nn_module.register_module_forward_pre_hook(self._pre),
                         nn_module.register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._open = []

    def _counts(self) -> bool:
        # (inside code torch.compile traces: nothing, so the hook adds no break to its graph;
        # the compiled call itself is one op of ours, its span recorded outside)
        return (not torch.compiler.is_compiling() and threading.get_ident() == self._thread
                and torch._C._current_graph_task_id() == -1)

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if self._counts():
            self._open.append((module, self._clock()))

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._counts() or not self._open or self._open[-1][0] is not module:
            return  # a call that raised inside left its frame open: the stack is off, stop there
        _, first = self._open.pop()
        self.spans.append(ModuleSpan(weakref.ref(module), first, self._clock(), len(self._open)))
