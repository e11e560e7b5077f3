"""The fast path: a step whose plan moves nothing runs without the dispatch mode.

Every op through a Python ``TorchDispatchMode`` costs more host time than many GPU kernels
take: a do-nothing mode alone is 1.71x a plain HF Llama step's host time on this CPU, while
``saved_tensors_hooks`` with an identity pack cost 1.05x and ones that fingerprint every
saved tensor 1.15x (``benchmarks/results/host_cost_mechanisms.json``; the peers,
``save_on_cpu`` and torchtune's offloading, work the same way). So once a structure's
plan moves nothing at the step's budget and a checked replay of it ran clean, its later
steps run plainly under ``SavedTensorGuard``: autograd hands every tensor it saves to
``pack``, which compares the tensor's fingerprint (shape, dtype, which earlier saved
tensor shares its storage, offset, version counter of non-leaves) with the one the checked
replay recorded at the same position. Nothing is moved on this path, so no byte can be
stale; what the check guards is the budget and the report: saved tensors of the plan's
shapes, aliasing and count are the plan's activations, whose peak the plan knows.

A step that departs (another shape or dtype, other aliasing, an in-place write the plan
did not have, more saved tensors than the plan) is caught at the first saved tensor that
differs, before it can grow further: ``FallbackExecutor`` takes the rest of the step on
warmup's online path (the dispatch mode, evicting to keep the budget), starting from the
saved tensors seen so far as its activations. Activations that no backward saves and that
were made before the departure are not seen by it (they stay on the device and uncounted).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from hyperpar.offload.capture.mode.executor_base import ExecutorBase
from hyperpar.offload.ir.report import StepReport

Tensor = torch.Tensor


class FallbackExecutor(ExecutorBase):
    """The rest of a fast step that departed from its plan: warmup's online path, nothing
    recorded, the saved tensors seen so far bound as its activations (oldest first)."""

    phase = "replay"

    def __init__(self, manager: Any, device: torch.device, budget_bytes: int, departed_at: int,
                 why: str, storages: list[weakref.ref]) -> None:
        super().__init__(manager, device, budget_bytes)
        self.departed_at = departed_at
        self.why = why
        self.held_bytes = 0  # released storages Python still held (the fast path's moves)
        self.held_sids: frozenset[int] = frozenset()
        self.fast_moves: Any = None  # the fast part's ``MovingStep``: its copies count in the report
        self.missed: Any = None  # the first saved tensor's fingerprint, where no plan covered it
        table, seen = self.table, set()
        for k, ref in enumerate(storages):  # producers before op 0, oldest first (evicted first)
            st = ref()
            if st is None or id(st) in seen or st.device != device or not st.nbytes():
                continue
            seen.add(id(st))
            table.bind_new(st, st.nbytes(), k - len(storages))
        self.start_online()
        self.note_peak(0)

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.online_op(func, args, kwargs)

    def begin_opaque(self, name: str, reads: list[torch.UntypedStorage]) -> Any:
        return self.online_begin_opaque(name, reads)

    def end_opaque(self, token: Any, outputs: list[Tensor]) -> None:
        self.online_end_opaque(token, outputs)

    def report(self, step_ms: float, **extra: Any) -> StepReport:
        return super().report(step_ms, departed_at_saved=self.departed_at, replay_path="fallback", **extra)
