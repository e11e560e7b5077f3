"""Teardown that never communicates: the ``closing`` block and the interpreter-exit release.

Nothing here patches torch. A collective close needs every peer, and on a failure path the
peers may be anywhere (inside another collective, or gone): teardown after an exception and at
interpreter exit therefore releases what this rank holds and logs it, without waiting for
anyone, so that a failing rank leaves at once. ``destroy_process_group`` is torch's own; a
``close()`` after it runs on this rank alone (the root group is gone, see ``Scope``).
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from hyperpar.multicore.module import MulticoreModule

logger = logging.getLogger(__name__)

LEFT_AFTER_EXCEPTION = "an exception left a closing() block"


@contextmanager
def closing(modules: Iterable[MulticoreModule]) -> Iterator[list[MulticoreModule]]:
    """Close ``modules`` when the block ends: collectively and in order (``close()``) when it
    ends normally; on this rank alone, without communicating, when an exception leaves it (the
    peers may be elsewhere), logging each group so released. Yields the modules as a list."""
    members = list(modules)
    try:
        yield members
    except BaseException:
        for module in members:
            try:
                module._release_locally(LEFT_AFTER_EXCEPTION)
            except Exception:  # the original exception matters more
                logger.exception("releasing %s after an exception failed", type(module).__name__)
        raise
    for module in members:
        module.close()


def _release_at_exit() -> None:
    from hyperpar.multicore.manager import MANAGER  # looked up now: tests swap the instance

    try:
        MANAGER.close_all_at_exit()
    except Exception:
        logger.exception("releasing execution resources at interpreter exit failed")


atexit.register(_release_at_exit)
