"""Errors raised by capture: a step that is not the traced one, compiled code it cannot see."""

from __future__ import annotations


class OffloadDivergenceError(RuntimeError):
    """Replay met an op (or op count) that differs from the trace."""


class OffloadCompileError(RuntimeError):
    """torch.compile'd code started inside a session step outside a compiled region."""
