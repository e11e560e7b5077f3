"""Planning, and a warmup step recording its trace, allocate hundreds of thousands of small
objects that form no cycles; the cyclic garbage collector would rescan them over and over,
so it is paused meanwhile (measured: a 36k-op warmup step took 1.5x as long with it)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def hold() -> None:
    """Pause the collector until the matching ``release`` (counted: sessions on several
    threads may hold it at once)."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1


def release() -> None:
    global _holders
    with _lock:
        _holders -= 1
        if _holders == 0 and _was_enabled:
            gc.enable()
