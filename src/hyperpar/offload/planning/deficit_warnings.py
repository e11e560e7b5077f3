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


@contextlib.contextmanager
def deficit_warnings_muted() -> Iterator[None]:
    """For callers that report the deficit themselves (a sweep's table, ``hyperpar plan``)."""
    loggers = [logging.getLogger(name) for name in DEFICIT_LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
