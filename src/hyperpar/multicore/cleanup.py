"""Automatic cleanup: before a dependency process group is destroyed, and at interpreter exit.

Which torch entry point to hook: ``destroy_process_group(group=None)`` is public and has the
same shape from torch 2.6 to 2.13, while what it calls to tear a group down is not: 2.6 calls
the private ``_shutdown_backend(pg)`` (which only acts on NCCL backends), later releases
(2.13 here) call ``ProcessGroup.shutdown()``, and at that point ``comm.finalize()`` may already
have run for the world. A hook on either would be version-specific and would run with the group
half torn down. So we wrap ``destroy_process_group`` itself, under both of its names
(``torch.distributed`` and ``torch.distributed.distributed_c10d``): our collective close runs
first, while the group is fully usable, on every rank that calls it, and only for the groups
whose root is the one being destroyed (all of them for the world). Code that imported the
function by name before our first binding keeps the unwrapped one; ``atexit`` still covers it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

_MARKER = "__hyperpar_cleanup_wrapper__"
_install_lock = threading.Lock()
_installed = False


def _wrap_destroy(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        from hyperpar.multicore.manager import MANAGER

        try:
            if dist.is_initialized():
                MANAGER.close_before_destroy(group)
        except Exception:
            # Destroying must go on; whatever could not close stays owned and is reported at exit.
            logger.exception("closing execution resources before destroy_process_group failed")
        return original(group, *args, **kwargs)

    setattr(destroy_process_group, _MARKER, original)
    return destroy_process_group


def _close_at_exit() -> None:
    from hyperpar.multicore.manager import MANAGER

    try:
        MANAGER.close_all_at_exit()
    except Exception:
        logger.exception("closing execution resources at interpreter exit failed")


def install_cleanup_hooks() -> None:
    """Install the destroy_process_group wrapper and the atexit hook, once per process."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        if dist.is_available():
            from torch.distributed import distributed_c10d

            wrappers: dict[int, Callable[..., Any]] = {}
            for module in (distributed_c10d, dist):
                current = getattr(module, "destroy_process_group", None)
                if current is not None and not hasattr(current, _MARKER):
                    if id(current) not in wrappers:
                        wrappers[id(current)] = _wrap_destroy(current)
                    module.destroy_process_group = wrappers[id(current)]
        atexit.register(_close_at_exit)
        _installed = True
        logger.debug("installed execution-resource cleanup hooks")


def cleanup_hooks_installed() -> bool:
    return _installed
