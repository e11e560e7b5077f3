"""Errors raised by capture when a step is not the step that was traced."""

from __future__ import annotations


class OffloadDivergenceError(RuntimeError):
    """Replay met an op (or op count) that differs from the trace."""
