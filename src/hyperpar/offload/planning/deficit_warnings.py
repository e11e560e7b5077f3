"""Muting the planners' "plan exceeds the budget" warning for callers that say it themselves.

Its own file because both the sweep (which plans through ``tails``) and ``tails`` (which
plans twice and warns once) need it: in either of them it would make the two import each
other.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from hyperpar.offload.planning import prediction, timed

# The loggers that say "plan exceeds the budget": every planner reports through one of them.
DEFICIT_LOGGERS = (prediction.__name__, timed.__name__)


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


_MUTE = _BelowError()


@contextlib.contextmanager
def deficit_warnings_muted() -> Iterator[None]:
    """For callers that report the deficit themselves (a sweep's table, ``hyperpar plan``).
    A filter, not ``setLevel``: that clears the cache of every logger in the process (with
    transformers imported, 0.8 ms of each warmup step on HF Llama)."""
    loggers = [logging.getLogger(name) for name in DEFICIT_LOGGERS]
    added = [log for log in loggers if _MUTE not in log.filters]
    for log in added:
        log.addFilter(_MUTE)
    try:
        yield
    finally:
        for log in added:
            log.removeFilter(_MUTE)
