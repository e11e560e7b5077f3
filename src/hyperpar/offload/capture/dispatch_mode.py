"""The TorchDispatchMode that routes every aten op of a session step to its executor."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from hyperpar.offload.capture.executor_base import ExecutorBase


class OffloadDispatchMode(TorchDispatchMode):
    def __init__(self, executor: ExecutorBase) -> None:
        super().__init__()
        self.executor = executor

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        return self.executor.dispatch(func, args, kwargs or {})
