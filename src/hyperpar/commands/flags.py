"""Checked numeric flags: a bad value exits naming the command, the flag and the text given."""

from __future__ import annotations

import math


def non_negative(command: str, flag: str, text: str, unit: str) -> float:
    """``text`` as a finite number >= 0, else ``SystemExit`` saying which flag got what."""
    try:
        value = float(text)
    except ValueError:
        raise SystemExit(f"hyperpar {command}: {flag} must be a number of {unit}, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise SystemExit(f"hyperpar {command}: {flag} must be finite and >= 0, got {text!r}")
    return value


def positive(command: str, flag: str, text: str, unit: str) -> float:
    """``text`` as a finite number > 0 (a budget or a bandwidth of 0 means nothing), else ``SystemExit``."""
    try:
        value = float(text)
    except ValueError:
        raise SystemExit(f"hyperpar {command}: {flag} must be a number of {unit}, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise SystemExit(f"hyperpar {command}: {flag} must be finite and > 0, got {text!r}")
    return value
