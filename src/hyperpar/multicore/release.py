"""The runtime release's hooks, run so that a retry repeats only what failed.

A release hook frees a process-wide native runtime (a communicator, a handle pool). Running one
that already succeeded a second time would free it twice, so a failed release remembers, on each
rank, exactly the hooks that raised there; the retry runs those and nothing else. A rank with
nothing left still takes part in the retry's agreement, so no peer waits for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

Hook = tuple[str, Callable[[], None]]  # (name for logs and errors, the hook)


class ReleaseHooks:
    """The hooks one runtime release still has to run on this rank."""

    __slots__ = ("pending",)

    def __init__(self, hooks: Sequence[Hook]) -> None:
        self.pending: list[Hook] = list(hooks)

    def run(self) -> None:
        """Run every pending hook once, even after one fails (each frees something of its own);
        the ones that raised stay pending. Raises the first failure, so its type reaches the
        peers; the others are logged."""
        failed: list[Hook] = []
        first: Exception | None = None
        for name, hook in self.pending:
            try:
                hook()
            except Exception as exc:
                failed.append((name, hook))
                if first is None:
                    first = exc
                else:
                    logger.error("runtime release hook %s failed too: %s: %s", name, type(exc).__name__, exc)
        self.pending = failed
        if first is not None:
            logger.warning("runtime release hook(s) %s failed; a later close() retries only these",
                           ", ".join(name for name, _ in failed))
            raise first
