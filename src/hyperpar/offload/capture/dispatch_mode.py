"""The TorchDispatchMode that routes every aten op of a session step to its executor."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from hyperpar.offload.capture.executor_base import ExecutorBase


class OffloadDispatchMode(TorchDispatchMode):
    def __init__(self, executor: ExecutorBase, session: Any = None) -> None:
        super().__init__()
        self.executor = executor
        self.session = session

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Dynamo never compiles while this mode is active (it is not an infra mode), so the
        per-op wrapper that would keep it out of our dispatch code only costs time."""
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        return self.executor.dispatch(func, types, args, kwargs)


def current_offload_mode() -> OffloadDispatchMode | None:
    """The offload mode this thread's ops go through now, if any.

    The dispatch mode stack is thread-local state that autograd hands to the threads it runs
    backward on, so this also finds the session from a backward hook on a device thread,
    where a context variable set by the step's thread would not be visible.
    """
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, OffloadDispatchMode):
            return mode
    return None
