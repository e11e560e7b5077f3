"""The one switch tests compare on: a step run inside an OffloadSession, or plainly."""

from __future__ import annotations

import contextlib
from typing import Any

from hyperpar.offload import OffloadSession


def step_context(session: OffloadSession | None) -> Any:
    """``session`` itself, or a context that does nothing for the plain run."""
    return contextlib.nullcontext() if session is None else session
